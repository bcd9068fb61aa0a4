"""Request-level batching (static and dynamic); waiting-queue policies live
in :mod:`worker.engine.policies`.

Static batching waits for ``batch_size`` requests and runs them to completion;
dynamic batching starts a partial batch ``max_wait_s`` after its oldest
request arrived (the "batch timeout" of request-level servers such as Triton's
dynamic batcher). Both reserve worst-case KV blocks (prompt + max_tokens) per
request at batch formation, so they never preempt. Continuous batching
(Orca, Yu et al. OSDI'22) lives in :mod:`worker.engine.scheduler`.
"""

from __future__ import annotations

from worker.engine.sequence import Sequence

def worst_case_tokens(seq: Sequence, max_model_len: int) -> int:
    """KV slots a request can ever need: prompt + max_tokens, capped at the
    context length (tokens)."""
    return min(seq.num_prompt_tokens + seq.params.max_tokens, max_model_len)


def batch_ready(waiting: list[Sequence], batch_size: int, max_wait_s: float, now: float) -> bool:
    """True when a request-level batch should start now: ``batch_size``
    requests wait, or the oldest has waited ``max_wait_s`` seconds (static
    batching passes ``inf``)."""
    if not waiting:
        return False
    if len(waiting) >= batch_size:
        return True
    oldest = min(s.arrival_time for s in waiting)
    return now - oldest >= max_wait_s


def batch_deadline(waiting: list[Sequence], batch_size: int, max_wait_s: float) -> float | None:
    """Clock time (seconds) at which a partial batch will start, or None
    when nothing waits or the batch waits to be full (static)."""
    if not waiting or max_wait_s == float("inf"):
        return None
    if len(waiting) >= batch_size:
        return min(s.arrival_time for s in waiting)
    return min(s.arrival_time for s in waiting) + max_wait_s
