"""IncrementalDetokenizer: split characters, leading spaces, stop strings."""

import pytest

from tests.worker.fakes import fake_tokenizer
from worker.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer

TEXTS = ["你好，世界 🚀 hello 語", " leading space and 😀😀 emoji 👍🏽", "日本語のテキスト。こんにちは"]


def _stream(tok, ids, stop=(), prompt=(), skip=True, flush=True):
    """Deltas for ``ids`` and whether a stop string ended them; ``flush=False`` is a
    stream cut short (what a client had when its worker died)."""
    d = IncrementalDetokenizer(tok, list(prompt), stop, skip)
    deltas = []
    for t in ids:
        u = d.add_token(t)
        deltas.append(u.text_delta)
        if u.stopped:
            return deltas, True
    if flush:
        deltas.append(d.flush())
    return deltas, False


@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_never_emit_replacement(text):
    tok = fake_tokenizer()
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)  # the BPE really splits characters
    deltas, _ = _stream(tok, ids, prompt=tok.encode("Hi:"))
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text


def test_special_tokens_skipped_or_kept():
    tok = fake_tokenizer()
    ids = tok.encode("hello") + [1] + tok.encode(" world")
    assert "".join(_stream(tok, ids)[0]) == "hello world"
    assert "".join(_stream(tok, ids, skip=False)[0]) == "hello<|im_start|> world"


@pytest.mark.parametrize("stop", [("world",), ("界",), ("o w", "zzz"), ("🚀",)])
def test_stop_string_cut_matches_one_shot(stop):
    tok = fake_tokenizer()
    text = "hello world 你好，世界 🚀 done"
    deltas, stopped = _stream(tok, tok.encode(text), stop=stop)
    first = min(i for s in stop if (i := text.find(s)) != -1)
    assert stopped and "".join(deltas) == text[:first]


def test_held_text_is_only_a_stop_prefix_and_flushes():
    tok = fake_tokenizer()
    d = IncrementalDetokenizer(tok, [], ("hello there",))
    out = "".join(d.add_token(t).text_delta for t in tok.encode("say hello"))
    assert out == "say "  # "hello" could start the stop string
    assert d.flush() == "hello"


def test_incomplete_character_at_end_flushes_like_one_shot():
    tok = fake_tokenizer()
    ids = tok.encode("ok 🚀")[:-1]
    deltas, _ = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)


@pytest.mark.parametrize("stop", [(), ("界",), ("o w",), ("🚀 d",)])
def test_resume_at_every_split_emits_the_rest_exactly_once(stop):
    """A continuation (gateway/continuation.py) replays the tokens a client already has
    and emits only the rest, even when the split falls inside a character, inside a
    held-back stop-string prefix, or right before a stop string that spans the split."""
    tok = fake_tokenizer()
    ids = tok.encode("hello world 你好，世界 🚀 done")
    whole, _ = _stream(tok, ids, stop=stop, prompt=tok.encode("Hi:"))
    for split in range(len(ids) + 1):
        first, stopped = _stream(tok, ids[:split], stop, prompt=tok.encode("Hi:"), flush=False)
        if stopped:
            continue  # the stream ended before this split: nothing to resume
        d = IncrementalDetokenizer(tok, tok.encode("Hi:"), stop)
        d.resume(ids[:split], "".join(first))
        rest = []
        for t in ids[split:]:
            u = d.add_token(t)
            rest.append(u.text_delta)
            if u.stopped:
                break
        else:
            rest.append(d.flush())
        assert "".join(first) + "".join(rest) == "".join(whole), split


def test_resume_rejects_text_that_is_not_the_tokens_text():
    tok = fake_tokenizer()
    d = IncrementalDetokenizer(tok, [], ())
    with pytest.raises(ValueError):
        d.resume(tok.encode("hello"), "goodbye")
