"""One tokenizer's fingerprint: a hash of what decides its token ids, so a gateway can tell
that a worker tokenizes (and counts, caps, constrains) as it does (issue 44).

The hash covers the vocabulary (every token string and its id, added tokens included), the
BPE merges when the model has them, and the special tokens (which ids are control tokens,
BOS, EOS/end-of-generation ids); not the normalizer's or pre-tokenizer's JSON spelling, so a
model's tokenizer loaded from its GGUF header and from its Hugging Face folder agree when
their vocabularies, merges and special tokens do.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: Hex digits of SHA-256 kept (64 bits: a collision by chance is not a concern here).
FINGERPRINT_HEX = 16


def _merges(hf: Any) -> list[str]:
    """The BPE merges of a ``tokenizers.Tokenizer`` as ``"a b"`` strings ([] when none:
    WordPiece, Unigram, or a double without ``to_str``)."""
    to_str = getattr(hf, "to_str", None)
    if to_str is None:
        return []
    merges = json.loads(to_str()).get("model", {}).get("merges") or []
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The fingerprint of ``tokenizer`` (a :class:`common.tokenizer.Tokenizer`, or any
    object with ``hf``, ``special_token_ids``, ``bos_token_id`` and ``eos_token_ids``; a
    double without ``hf`` is hashed from its ``vocab_size`` and those ids).

    Returns:
        16 lowercase hex digits (the head of a SHA-256).
    """
    digest = hashlib.sha256()
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        vocab = hf.get_vocab(with_added_tokens=True)
        digest.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
        digest.update(json.dumps(_merges(hf), ensure_ascii=False).encode())
    else:
        digest.update(f"vocab_size={getattr(tokenizer, 'vocab_size', 0)}".encode())
    specials = {
        "special": sorted(int(i) for i in getattr(tokenizer, "special_token_ids", ())),
        "bos": getattr(tokenizer, "bos_token_id", None),
        "eos": sorted(int(i) for i in getattr(tokenizer, "eos_token_ids", ())),
    }
    digest.update(json.dumps(specials, sort_keys=True).encode())
    return digest.hexdigest()[:FINGERPRINT_HEX]
