"""SentencePiece vocabularies of GGUF files (``tokenizer.ggml.model == "llama"``) as a
``tokenizers`` pipeline that gives llama.cpp's ids.

Llama 2, Mistral v0.1, Phi-3 and Gemma 2/3 GGUFs carry a SentencePiece BPE vocabulary:
``tokenizer.ggml.tokens``, ``tokenizer.ggml.scores`` and ``tokenizer.ggml.token_type``, 256
byte-fallback tokens ``<0x00>``..``<0xFF>``, no merges. llama.cpp (``llm_tokenizer_spm`` in
``src/llama-vocab.cpp``, LLAMA_VOCAB_TYPE_SPM) tokenizes such a vocabulary as SentencePiece's
BPE does:

* the text is split at special tokens first (CONTROL and UNKNOWN tokens, and USER_DEFINED
  ones, matched on the raw text); each text fragment gets a leading space when
  ``tokenizer.ggml.add_space_prefix`` says so (default true; Gemma's converter writes
  false), then every space becomes ``▁`` (U+2581); there is no pre-tokenizer splitting;
* a fragment starts as one symbol per character, and the adjacent pair whose concatenation
  is a vocabulary token of the highest score is merged, again and again (ties: the leftmost);
* a symbol that is no token comes out as its UTF-8 bytes' ``<0xNN>`` tokens.

The same thing as a ``tokenizers`` BPE model: every way to cut a vocabulary token in two
tokens is a merge, ranked by the whole token's score (highest first), so the merge applied
next is always that of the highest-scoring token a pair can form (transformers'
``convert_slow_tokenizer.SentencePieceExtractor`` derives Llama's merges the same way);
``byte_fallback`` gives the ``<0xNN>`` tokens. The normalizer prepends ``▁`` and replaces
spaces, once per fragment between special tokens (``tokenizers`` normalizes each fragment
alone, as llama.cpp prefixes each one); the decoder turns ``▁`` back into spaces, fuses the
bytes into UTF-8 and drops the one leading space the prefix added (llama.cpp's
``remove_space`` in ``detokenize``).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

SPACE = "\u2581"  # SentencePiece's escaped space
# GGUF token types (gguf-py TokenType, SentencePiece's ModelProto.SentencePiece.Type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
                         ) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary, the highest-ranked first.

    Each NORMAL or USER_DEFINED token ``t`` (the tokens llama.cpp's SPM merge can form;
    CONTROL, UNKNOWN, UNUSED and BYTE tokens are never formed from text) gives one merge
    ``(t[:k], t[k:])`` for each cut ``k`` whose two sides are both tokens; merges are
    ordered by ``t``'s score, highest first, then by ``t``'s id, then by the cut.

    Args:
        tokens: token strings by id.
        scores: float scores by id (SentencePiece log-probabilities or negative ranks).
        types: GGUF token types by id.

    Returns:
        ``(left, right)`` pairs, rank 0 first.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    formable = (NORMAL, USER_DEFINED)
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in formable or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in vocab:  # the right side is cut only then: a 262k vocabulary takes seconds
                right = token[cut:]
                if right in vocab:
                    ranked.append((-float(scores[token_id]), token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_tokenizer(tokens: Sequence[str], scores: Sequence[float] | None,
                            types: Sequence[int] | None, *, add_space_prefix: bool,
                            unk_token_id: int | None) -> HFTokenizer:
    """The ``tokenizers`` pipeline of a GGUF SentencePiece vocabulary (module docstring).

    Args:
        tokens: ``tokenizer.ggml.tokens``.
        scores: ``tokenizer.ggml.scores`` (None: all 0, as llama.cpp reads a file without).
        types: ``tokenizer.ggml.token_type`` (None: all NORMAL).
        add_space_prefix: ``tokenizer.ggml.add_space_prefix`` (llama.cpp's default for SPM:
            true).
        unk_token_id: the unknown token (``tokenizer.ggml.unknown_token_id``), for characters
            neither a token nor covered by ``<0xNN>`` tokens.

    Returns:
        A ``tokenizers.Tokenizer``: CONTROL and UNKNOWN tokens registered as special tokens,
        USER_DEFINED ones as added (non-special) tokens, all matched on the raw text.
    """
    scores = list(scores) if scores is not None else [0.0] * len(tokens)
    types = list(types) if types is not None else [NORMAL] * len(tokens)
    unk = tokens[unk_token_id] if unk_token_id is not None and 0 <= unk_token_id < len(tokens) else None
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                       merges=sentencepiece_merges(tokens, scores, types),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    hf = HFTokenizer(model)
    escape = normalizers.Replace(" ", SPACE)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix else escape
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in zip(tokens, types) if k == USER_DEFINED])
    return hf
