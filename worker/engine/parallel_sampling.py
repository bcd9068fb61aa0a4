"""Parallel sampling (``n`` > 1): one request, ``n`` choices sampled from one prompt.

The prompt is prefilled once. Choice 0 runs first; the other ``n - 1`` choices wait
here until its prefill is done (its first token sampled). Then each is forked onto
choice 0's KV blocks (:meth:`worker.engine.scheduler.Scheduler.fork`): every block of
the prompt is shared by reference count, and the first choice to write into a shared
block (the prompt's last, partly filled one) gets a copy of it first (copy-on-write,
PagedAttention's block sharing, Kwon et al. SOSP'23 §4.4). A forked choice recomputes
only the prompt's last token, for logits of its own, whether prefix caching is on or
off. When the batch is full (or in the request-level batching modes) a choice waits
in the queue instead, and the prefix cache, when on, serves the prompt's full blocks.
A preempted choice resumes alone, through the prefix cache or by recomputing. Every
choice has its own seed, derived from the request's, so choice 0 of a seeded request
samples what ``n`` = 1 would.
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
