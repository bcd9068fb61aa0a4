"""Our GGUF tokenizer and chat template against transformers' own GGUF conversion."""

from __future__ import annotations

import pytest

from common.model_files import default_model_path, resolve_model_path
from common.token_bytes import TokenBytes
from common.tokenizer import load_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces 123456 and 3.14",
    "x=12345678901, y = 0.5e-3",
    "日本語のテキストと中文",
    "emoji 🤗🚀 ok 👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n",
    "tabs\tand\n\nnewlines   \n end",
    "don't won't I'll",
]
MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
]


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def theirs():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours, text):
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, add_generation_prompt):
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_metadata(ours):
    assert ours.eos_token_ids == frozenset({0, 2})
    assert ours.bos_token_id == 1
    assert ours.vocab_size == 49152
    assert ours.context_length == 8192
    assert {0, 1, 2} <= ours.special_token_ids
    assert ours.decode([1, 6004, 2]) == "hi"


def test_resolve_model_path(tmp_path):
    assert resolve_model_path(None) == default_model_path()
    assert resolve_model_path("smollm2") == default_model_path()
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError):
        resolve_model_path(str(tmp_path))


def test_hf_folder_loads_like_gguf(ours, tmp_path):
    import json

    ours.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": ours._chat_template_source, "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
    }))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    folder = load_tokenizer(tmp_path)
    assert folder.eos_token_ids == frozenset({0, 2}) and folder.bos_token_id == 1
    assert folder.context_length == 4096 and folder.model_name == tmp_path.name
    for text in TEXTS:
        assert folder.encode(text) == ours.encode(text)
        assert [folder.token_bytes(i) for i in ours.encode(text)] == [ours.token_bytes(i) for i in ours.encode(text)]
    assert folder.apply_chat_template(MESSAGES[1]) == ours.apply_chat_template(MESSAGES[1])


def test_template_raise_exception_becomes_value_error(ours, tmp_path):
    from common.tokenizer import Tokenizer

    broken = Tokenizer(ours.hf, ours._specials, chat_template="{{ raise_exception('no system role') }}",
                       context_length=8, model_name="x")
    with pytest.raises(ValueError, match="no system role"):
        broken.apply_chat_template(MESSAGES[0])


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_text(ours, text):
    """Each token's raw bytes, joined, are the text's UTF-8, also where a token holds
    part of a character and decodes alone to U+FFFD (the CJK and emoji texts)."""
    ids = ours.encode(text)
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()
    if not text.isascii():
        assert any("\ufffd" in ours.decode([i]) for i in ids)  # the case the bytes are for


def test_token_bytes_of_sentencepiece_byte_fallback_pieces():
    """``<0xNN>`` pieces are that byte and ``▁`` a space (llama-style vocabularies)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xBD>": 2, "\u2581hi": 3, "a": 4}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    token_bytes = TokenBytes(hf)
    assert [token_bytes(i) for i in (1, 2, 3, 4)] == [b"\xe4", b"\xbd", b" hi", b"a"]
    with pytest.raises(ValueError):
        token_bytes(99)
