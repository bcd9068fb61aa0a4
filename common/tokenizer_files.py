"""Reading a tokenizer out of a model's files: a GGUF header or an HF folder.

GGUF (``tokenizer.ggml.model == "gpt2"``): byte-level BPE built with the
``tokenizers`` library from the file's vocabulary and merges. Pre-tokenizer by
``tokenizer.ggml.pre``: ``"smollm"`` splits every digit on its own and then
applies GPT-2's byte-level regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM and
the ``Digits(individual_digits=True)`` + ``ByteLevel`` pipeline of SmolLM2's
``tokenizer.json``); other values fall back to plain GPT-2 byte-level splitting
(what transformers' GGUF converter does for every unknown ``pre``). Tokens of
type CONTROL (3) are registered as special, USER_DEFINED (4) as added tokens.

GGUF (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral v0.1, Phi-3, Gemma 2/3):
SentencePiece BPE from the vocabulary and its scores, with byte fallback, as
llama.cpp's LLAMA_VOCAB_TYPE_SPM tokenizes it (:mod:`common.tokenizer_spm`); BOS is
added per ``tokenizer.ggml.add_bos_token`` (llama.cpp's default for these: true).
Any other ``tokenizer.ggml.model`` is refused in one line.

End-of-generation ids: the file's ``eos_token_id`` plus any special token named
in :data:`EOG_TOKEN_NAMES` (``<|endoftext|>``, ``<|im_end|>``, ...), as
llama.cpp builds its ``special_eog_ids``. For SmolLM2 that is {2 ``<|im_end|>``,
0 ``<|endoftext|>``}; Hugging Face's generation_config uses only 2, but a model
that emits ``<|endoftext|>`` has ended its document and anything after it is
unconditioned, so we stop there too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

DEFAULT_CONTEXT_LENGTH = 2048

@dataclass(frozen=True)
class _Specials:
    """Token ids and strings the template and the engine need."""

    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    bos_token: str
    eos_token: str
    add_bos_token: bool


@dataclass(frozen=True)
class TokenizerFiles:
    """What a model's files say about its tokenizer: the arguments of
    :class:`common.tokenizer.Tokenizer` (which ``load_tokenizer`` builds from them)."""

    hf: HFTokenizer
    specials: _Specials
    chat_template: str | None
    context_length: int
    model_name: str


GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4
EOG_TOKEN_NAMES = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>"}
)
# llama.cpp's ids for a SentencePiece ("llama") vocabulary whose header names none.
_SPM_DEFAULT_IDS = {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                    "tokenizer.ggml.unknown_token_id": 0}
# llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3 split (also transformers' GGUF converter).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------- GGUF


def gguf_fields(path: Path) -> dict[str, Any]:
    """The header fields of a GGUF file, name -> value (the shared mapped reader's, ``GGUF.*``
    layout fields left out)."""
    from common.gguf_file import gguf_reader  # numpy and gguf; imported lazily to keep import light

    reader = gguf_reader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def load_gguf(path: Path) -> TokenizerFiles:
    """The tokenizer parts of a GGUF file (the kinds in this module's docstring).

    Raises:
        ValueError: an unsupported ``tokenizer.ggml.model``.
    """
    meta = gguf_fields(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        hf = _byte_level_bpe(meta, tokens, types)
    elif kind == "llama":
        from common.tokenizer_spm import sentencepiece_tokenizer

        unk = meta.get("tokenizer.ggml.unknown_token_id", _SPM_DEFAULT_IDS["tokenizer.ggml.unknown_token_id"])
        hf = sentencepiece_tokenizer(
            tokens, meta.get("tokenizer.ggml.scores"), types,
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            unk_token_id=int(unk) if unk is not None else None)
    else:
        raise ValueError(f"{path.name}: tokenizer.ggml.model={kind!r} unsupported "
                         "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    arch = meta.get("general.architecture", "llama")
    return TokenizerFiles(
        hf,
        _gguf_specials(meta, tokens, types, sentencepiece=kind == "llama"),
        chat_template=meta.get("tokenizer.chat_template"),
        context_length=int(meta.get(f"{arch}.context_length", DEFAULT_CONTEXT_LENGTH)),
        model_name=path.name.removesuffix(".gguf"),
    )


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> HFTokenizer:
    """``tokenizer.ggml.model == "gpt2"``: byte-level BPE from the file's merges."""
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    hf.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == GGUF_TOKEN_TYPE_CONTROL]
    )
    hf.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == GGUF_TOKEN_TYPE_USER_DEFINED]
    )
    return hf


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """Pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


def _gguf_specials(meta: dict[str, Any], tokens: list[str], types: list[int], *,
                   sentencepiece: bool = False) -> _Specials:
    """BOS/EOS and the end-of-generation ids of a GGUF header. A SentencePiece vocabulary
    takes llama.cpp's LLAMA_VOCAB_TYPE_SPM defaults where the header is silent: BOS 1, EOS 2,
    ``add_bos_token`` true; an end-of-turn name (:data:`EOG_TOKEN_NAMES`) counts whether the
    token is CONTROL or USER_DEFINED (llama.cpp finds it by its text alone)."""
    defaults = _SPM_DEFAULT_IDS if sentencepiece else {}
    bos = meta.get("tokenizer.ggml.bos_token_id", defaults.get("tokenizer.ggml.bos_token_id"))
    eos = meta.get("tokenizer.ggml.eos_token_id", defaults.get("tokenizer.ggml.eos_token_id"))
    bos = int(bos) if bos is not None and 0 <= int(bos) < len(tokens) else None
    eos = int(eos) if eos is not None and 0 <= int(eos) < len(tokens) else None
    named = (GGUF_TOKEN_TYPE_CONTROL, GGUF_TOKEN_TYPE_USER_DEFINED)
    eog = {i for i, (t, k) in enumerate(zip(tokens, types)) if k in named and t in EOG_TOKEN_NAMES}
    if eos is not None:
        eog.add(eos)
    if meta.get("tokenizer.ggml.eot_token_id") is not None:
        eog.add(int(meta["tokenizer.ggml.eot_token_id"]))
    return _Specials(
        bos_token_id=bos,
        eos_token_ids=frozenset(eog),
        bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos] if eos is not None else "",
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)) and bos is not None,
    )


# ---------------------------------------------------------------- HF folder


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value or ""


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def load_hf_folder(path: Path) -> TokenizerFiles:
    """The tokenizer parts of an HF folder (``tokenizer.json``, ``tokenizer_config.json``,
    ``config.json``, optional ``generation_config.json`` and ``chat_template.jinja``).

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
    """
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no tokenizer.json")
    hf = HFTokenizer.from_file(str(tokenizer_file))
    tok_cfg = _read_json(path / "tokenizer_config.json")
    cfg = _read_json(path / "config.json")
    gen = _read_json(path / "generation_config.json")
    bos_token, eos_token = _token_content(tok_cfg.get("bos_token")), _token_content(tok_cfg.get("eos_token"))
    eog = _as_id_set(gen.get("eos_token_id")) | _as_id_set(cfg.get("eos_token_id"))
    if eos_token and hf.token_to_id(eos_token) is not None:
        eog.add(hf.token_to_id(eos_token))
    bos_id = cfg.get("bos_token_id", hf.token_to_id(bos_token) if bos_token else None)
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    return TokenizerFiles(
        hf,
        _Specials(bos_id, frozenset(eog), bos_token, eos_token, add_bos_token=False),
        chat_template=template if isinstance(template, str) else None,
        context_length=int(cfg.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH)),
        model_name=path.name,
    )
