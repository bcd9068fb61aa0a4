"""Parallel sampling (``n`` > 1): one request, ``n`` choices sampled from one prompt.

The prompt is prefilled once. Choice 0 runs first; the other ``n - 1`` choices wait
here until its prefill is done (its first token sampled), then join the waiting
queue and find the prompt's full KV blocks in the prefix cache, shared by reference
count (PagedAttention's block sharing, Kwon et al. SOSP'23 §4.4). Each sibling
recomputes only the prompt's last partial block instead of copying it, as vLLM's V1
engine fans ``n`` out over its prefix cache. With prefix caching off each choice
prefills the prompt itself. Every choice has its own seed, derived from the
request's, so choice 0 of a seeded request samples what ``n`` = 1 would.
"""

from __future__ import annotations

import dataclasses

from worker.engine.sampler import seed_for_step
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import Sequence

#: Added to the choice index before mixing, so a choice's seed is never the seed of one of
#: the request's own draws (those mix the output index, far below 2**48).
CHOICE_SEED_OFFSET = 1 << 48


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice ``index``: the request's, with a seed of its
    own (splitmix64 of the request's seed and the index; choice 0 keeps the seed)."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=seed_for_step(params.seed, CHOICE_SEED_OFFSET + index) & ((1 << 63) - 1))


class ForkQueue:
    """The choices waiting for their first sibling's prefill, keyed by its ``seq_id``."""

    def __init__(self) -> None:
        self._waiting: dict[int, list[Sequence]] = {}

    def hold(self, first: Sequence, siblings: list[Sequence]) -> None:
        """Keep ``siblings`` until ``first``'s prefill is done."""
        if siblings:
            self._waiting[first.seq_id] = siblings

    def release(self, first: Sequence) -> list[Sequence]:
        """The siblings held for ``first`` (none when there are none or they went already)."""
        return self._waiting.pop(first.seq_id, [])

    def __len__(self) -> int:
        """Choices held."""
        return sum(len(s) for s in self._waiting.values())
