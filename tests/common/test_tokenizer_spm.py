"""GGUF SentencePiece vocabularies (``tokenizer.ggml.model = "llama"``: Llama 2, Mistral,
Phi-3, Gemma) against the real ``sentencepiece`` library, on a model trained here
(tests/helpers/sentencepiece_gguf.py) and written into a GGUF as llama.cpp's converter writes
it: Llama's space prefix and Gemma's none, BOS as the header says, byte fallback for what the
vocabulary lacks, special tokens in text split out as llama.cpp does."""

from __future__ import annotations

import random

import pytest

from common.tokenizer import load_tokenizer
from tests.helpers.sentencepiece_gguf import (CONTROL_SYMBOLS, USER_DEFINED_SYMBOLS, add_sentencepiece_vocab,
                                              processor, trained_vocab)

gguf = pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")

TEXTS = [
    "Beautiful is better than ugly.",
    "Hello world",
    " leading space",
    "   three leading, two trailing  ",
    "multiple    spaces   between",
    "line\nbreaks\n\nand a trailing newline\n",
    "\n",
    " ",
    "tabs\tand\ttabs",
    "Le café est très chaud ? Où ?",
    "日本語のテキストと中文",
    "emoji 🤗🚀 ok 👍🏽 and Ωmega ẞ",  # not in the vocabulary: <0xNN> byte fallback
    "x = 3.14159 * 2",
    "",
]
VARIANTS = {"llama": True, "gemma": False}  # add_space_prefix: Llama 2/Mistral/Phi-3 vs Gemma


def _write(path, vocab, *, add_space_prefix: bool, add_bos: bool | None):
    writer = gguf.GGUFWriter(str(path), "llama" if add_space_prefix else "gemma2")
    writer.add_context_length(512)
    add_sentencepiece_vocab(writer, vocab, add_space_prefix=add_space_prefix, add_bos=add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocab():
    return trained_vocab()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, vocab, tmp_path_factory):
    """(our tokenizer, sentencepiece's processor, add_space_prefix, the file) of one variant. The Llama
    file leaves ``add_bos_token`` out (llama.cpp's default for SentencePiece: add it)."""
    prefix = VARIANTS[request.param]
    path = _write(tmp_path_factory.mktemp("spm") / f"{request.param}.gguf", vocab,
                  add_space_prefix=prefix, add_bos=None if prefix else True)
    return load_tokenizer(path), processor(vocab, add_dummy_prefix=prefix), prefix, path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_sentencepiece(pair, vocab, text):
    ours, sp, *_ = pair
    expected = sp.encode(text)
    assert ours.encode(text) == expected
    assert ours.encode(text, add_special_tokens=True) == [vocab.bos_id, *expected]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_matches_sentencepiece(pair, text):
    ours, sp, prefix, _ = pair
    ids = ours.encode(text)
    assert ours.decode(ids) == text == sp.decode(ids)
    assert ours.decode(ours.encode(text, add_special_tokens=True)) == text  # BOS skipped
    assert b"".join(ours.token_bytes(i) for i in ids) == ((" " if prefix and text else "") + text).encode()


def test_random_text_matches_sentencepiece(pair):
    """400 strings: slices of the training text and random runs of its characters, spaces,
    newlines and characters it lacks (byte fallback)."""
    from tests.helpers.sentencepiece_gguf import _corpus

    ours, sp, *_ = pair
    corpus, rng = _corpus(), random.Random(0)
    alphabet = sorted(set(corpus)) + [" ", "  ", "\n", "\t", "🤗", "ẞ", "\u00a0", "é"]
    for n in range(400):
        if n % 2:
            start = rng.randrange(len(corpus))
            text = corpus[start:start + rng.randrange(1, 80)]
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = ours.encode(text)
        assert ids == sp.encode(text), text
        assert ours.decode(ids) == text


def _llama_cpp_ids(sp, text: str, specials: dict[str, int]) -> list[int]:
    """llama.cpp's ids with special tokens parsed (``tokenizer_st_partition`` then
    ``llm_tokenizer_spm`` per fragment): the text is cut at each special token's string, and
    every text fragment is tokenized alone, with the space prefix where the vocabulary has one
    (sentencepiece's dummy prefix, added to each fragment as llama.cpp does)."""
    import re

    pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    ids: list[int] = []
    for piece in re.split(f"({pattern})", text):
        if piece in specials:
            ids.append(specials[piece])
        elif piece:
            ids += sp.encode(piece)
    return ids


@pytest.mark.parametrize("text", [
    "<start_of_turn>user\nWrite a poem<end_of_turn>\n<start_of_turn>model\n",
    "before <tool> after<end_of_turn>",
    "<s>Now is better than never.</s>",
    "an <unk> inside",
])
def test_special_tokens_in_text_split_as_llama_cpp_does(pair, vocab, text):
    """CONTROL and UNKNOWN tokens (with special-token parsing on) and USER_DEFINED ones become
    their ids; the text around them is SentencePiece's, one fragment at a time. With matching
    off (``encode_text``), a control token's string is plain text: SentencePiece's ids."""
    ours, sp, *_ = pair
    specials = {vocab.tokens[i]: i for i, kind in enumerate(vocab.types) if kind in (2, 3, 4)}
    assert set(CONTROL_SYMBOLS) | set(USER_DEFINED_SYMBOLS) | {"<s>", "</s>", "<unk>"} <= set(specials)
    assert ours.encode(text) == _llama_cpp_ids(sp, text, specials)
    if "<tool>" not in text:  # a USER_DEFINED token is matched even then (llama.cpp, tokenizers alike)
        assert ours.encode_text(text) == sp.encode(text)


def test_header_fields(pair, vocab, tmp_path):
    ours, _, prefix, _ = pair
    assert ours.bos_token_id == vocab.bos_id and ours.vocab_size == len(vocab.tokens)
    assert ours.eos_token_ids == {vocab.eos_id, vocab.tokens.index("<end_of_turn>")}  # llama.cpp's EOG by name
    assert {0, 1, 2, 3, 4} <= ours.special_token_ids and 5 not in ours.special_token_ids  # <tool>: user-defined
    assert ours.context_length == 512
    no_bos = load_tokenizer(_write(tmp_path / "no-bos.gguf", vocab, add_space_prefix=prefix, add_bos=False))
    assert no_bos.encode("Hello", add_special_tokens=True) == no_bos.encode("Hello")


def test_an_unknown_tokenizer_model_is_refused_in_one_line(vocab, tmp_path):
    path = tmp_path / "t5.gguf"
    writer = gguf.GGUFWriter(str(path), "t5")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(vocab.tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"^t5\.gguf: tokenizer\.ggml\.model='t5' unsupported \(supported: 'gpt2' "
                                         r"byte-level BPE, 'llama' SentencePiece\)$"):
        load_tokenizer(path)


def test_exported_folder_gives_transformers_the_same_ids(pair, tmp_path):
    """``inflight tokenizer export`` of a SentencePiece GGUF: transformers' fast tokenizer on
    the folder (what benchmark clients count with) gives our ids, BOS included. (transformers'
    own GGUF conversion does not: its Metaspace adds no ``▁`` to a text that starts with a
    space, nor after a special token, where SentencePiece and llama.cpp do.)"""
    transformers = pytest.importorskip("transformers")
    from common.tokenizer_export import export_tokenizer

    ours, *_, path = pair
    export_tokenizer(path, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in [*TEXTS, "<start_of_turn>user\nhi<end_of_turn>\n", "x <tool> y"]:
        assert theirs.encode(text) == ours.encode(text, add_special_tokens=True), text
        assert theirs.decode(ours.encode(text), skip_special_tokens=True) == ours.decode(ours.encode(text))


def test_a_text_completion_prompt_gets_the_bos_the_file_asks_for(pair, vocab, tmp_path):
    """/v1/completions: a text prompt is queued behind the BOS the GGUF asks for (vLLM and
    llama-server add it; Gemma without it answers badly), once even when the text starts with
    it; token-id prompts and a file that says add_bos_token = false get nothing added."""
    from gateway.admission.params import RequestParams
    from gateway.admission.validation import RequestLimits, validate_request

    ours, sp, prefix, _ = pair
    limits = RequestLimits(served_model="m", default_max_tokens=8)
    text = "Hello world"
    queued = validate_request(ours, limits, RequestParams(prompt=text)).prompt_token_ids
    assert list(queued) == [vocab.bos_id, *sp.encode(text)]
    assert validate_request(ours, limits, RequestParams(prompt=[text])).prompt_token_ids == queued
    ids = sp.encode(text)
    assert list(validate_request(ours, limits, RequestParams(prompt=ids)).prompt_token_ids) == ids
    bos_text = vocab.tokens[vocab.bos_id] + text
    assert validate_request(ours, limits, RequestParams(prompt=bos_text)).prompt_token_ids[:2] != (vocab.bos_id,) * 2
    no_bos = load_tokenizer(_write(tmp_path / "no-bos.gguf", vocab, add_space_prefix=prefix, add_bos=False))
    assert list(validate_request(no_bos, limits, RequestParams(prompt=text)).prompt_token_ids) == sp.encode(text)
