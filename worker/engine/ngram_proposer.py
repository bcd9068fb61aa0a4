"""Draft tokens without a draft model: n-gram prompt lookup.

The last ``n`` tokens of a sequence are looked up earlier in its own context
(prompt and output); the tokens that followed the most recent earlier match are
proposed as the continuation (prompt lookup decoding, Saxena 2023; vLLM's
``method: "ngram"``, llama.cpp's ``--spec-type ngram``). ``n`` goes from
``prompt_lookup_max`` down to ``prompt_lookup_min``: the longest suffix that
matches wins. It pays where outputs copy their context (rewriting, summarising,
code edits, extraction) and costs one vectorised scan of the context otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], num_tokens: int, prompt_lookup_min: int,
                  prompt_lookup_max: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens continuing ``token_ids``.

    Args:
        token_ids: the sequence so far (prompt + output), token ids.
        num_tokens: most draft tokens to return (k).
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first
            (1 <= min <= max).

    Returns:
        The tokens that followed the most recent earlier occurrence of the longest
        matching suffix (fewer than ``num_tokens`` when the context ends first);
        ``[]`` when no suffix of length ``prompt_lookup_min..prompt_lookup_max``
        occurs earlier, or ``num_tokens`` < 1.
    """
    length = len(token_ids)
    if num_tokens < 1 or length < prompt_lookup_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        start = _last_match(tokens, n)
        if start is not None:
            follow = start + n
            return tokens[follow:follow + num_tokens].tolist()
    return []


def _last_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the most recent occurrence of the last ``n`` tokens of ``tokens``
    [L] int64 that ends before the last token (so it has a follower), or None."""
    suffix = tokens[-n:]
    body = tokens[:-1]  # a match must be followed by at least one token
    if len(body) < n:
        return None
    starts = np.flatnonzero(body[n - 1:] == suffix[-1])  # windows ending in the right token
    if len(starts) == 0:
        return None
    windows = body[starts[:, None] + np.arange(n)]  # [candidates, n]
    hits = starts[(windows == suffix).all(axis=1)]
    return int(hits[-1]) if len(hits) else None
