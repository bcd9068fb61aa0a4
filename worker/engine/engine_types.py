"""Typed boundary of :class:`worker.engine.engine.LLMEngine` (requests in, outputs,
admission results and stats out)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from worker.engine.sampler import TokenLogprob
from worker.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A request handed to the engine.

    Attributes:
        request_id: caller's id, unique among unfinished requests.
        prompt_token_ids: prompt tokens (non-empty).
        sampling_params: sampling parameters.
        arrival_time: seconds on the engine's clock (time.monotonic by
            default) when the request arrived; None = when added.
        tenant: owner, for the "fair" policy's per-tenant share.
        priority: 0 = highest .. 2 = low; every policy orders higher
            priority first, and preemption takes the lowest first.
        resumed_token_ids: a continuation's output tokens that its client
            already has (another worker generated them). They are
            re-prefilled after the prompt, count against ``max_tokens`` and
            in ``completion_tokens``, and seeded sampling continues at their
            index; they are never emitted again.
        resumed_text: the text the client already has; only text beyond it
            is emitted.
        n: choices to sample from the prompt (parallel sampling, >= 1; see
            :mod:`worker.engine.parallel_sampling`); a continuation has one.
        lora_name: the LoRA adapter to run it with ("" = the base model; the queue's
            ``QueuedRequest.lora_name``); one the engine does not serve is refused (INVALID).
        pooling: set = an embeddings request (the queue's ``embedding``): only a pooling
            engine (worker/engine/pooling_engine.py) runs it; :class:`LLMEngine` refuses it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float | None = None
    tenant: str = ""
    priority: int = 1
    resumed_token_ids: list[int] = field(default_factory=list)
    resumed_text: str = ""
    n: int = 1
    lora_name: str = ""
    pooling: "PoolingParams | None" = None


@dataclass(frozen=True)
class PoolingParams:
    """What an embeddings request asks of the pooling engine (vLLM's ``PoolingParams``).

    Attributes:
        dimensions: keep the pooled vector's first ``dimensions`` values (Matryoshka);
            0 = the model's hidden size.
        normalize: L2-normalize the (truncated) vector, when the worker's pooler config
            normalizes too.
    """

    dimensions: int = 0
    normalize: bool = True


@dataclass(frozen=True)
class EmbeddingOutput:
    """A pooling engine's answer to one embeddings request (it ends the request).

    Attributes:
        request_id: the caller's id.
        values: the embedding, float32 values (length ``dimensions`` or the hidden size).
        prompt_tokens: the prompt's length in tokens.
    """

    request_id: str
    values: list[float]
    prompt_tokens: int
    finished: bool = True
    finish_reason: str = "stop"
    token_ids: tuple = ()  # no generated tokens (what the step metrics count)
    completion_tokens: int = 0
    index: int = 0


class AddStatus(enum.Enum):
    """Outcome of :meth:`LLMEngine.add_request`."""

    ACCEPTED = "accepted"
    NEVER_FITS = "never_fits"  # prompt + max_tokens beyond the context or the whole KV cache
    INVALID = "invalid"  # bad sampling parameters or empty prompt
    DUPLICATE = "duplicate"  # request_id already unfinished in the engine
    NO_ROOM = "no_room"  # only_if_room and it cannot start yet (it would wait)


@dataclass(frozen=True)
class AddResult:
    """Attributes:
        status: see :class:`AddStatus`.
        reason: human-readable reason when not accepted ("" if accepted).
    """

    status: AddStatus
    reason: str = ""

    @property
    def ok(self) -> bool:
        """True when the request was queued."""
        return self.status is AddStatus.ACCEPTED


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request.

    Attributes:
        request_id: the caller's id.
        text_delta: new text since the previous output.
        token_ids: new token ids since the previous output.
        finished: True on the request's last output.
        finish_reason: "stop" | "length" | "abort" | "error" | None.
        prompt_tokens: prompt length in tokens.
        completion_tokens: tokens generated so far (total).
        cached_prompt_tokens: prompt tokens served from the prefix cache.
        logprobs: per new token a TokenLogprob, when requested; else None.
        index: the choice (0 .. n-1) this output belongs to; a request with
            ``n`` choices is done when each has had its ``finished`` output.
        error: why a request finished with "error", for its client ("" otherwise).
        error_code: the link's ``Finished.error_code`` for it ("invalid_request": the
            request's own content failed, e.g. its grammar; "" means "internal").
    """

    request_id: str
    text_delta: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    error: str = ""
    error_code: str = ""


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is, cheap to take every loop (no block-table walk): what a
    worker publishes for the gateway's KV-aware router.

    Attributes:
        num_running, num_waiting: sequences running and waiting in the engine.
        num_free_blocks, num_total_blocks: KV blocks free now (empty or cached-evictable)
            and in the pool.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int


@dataclass(frozen=True)
class EngineStats:
    """Snapshot of the engine (for metrics and admission).

    Attributes:
        num_running, num_waiting: sequences in each queue.
        kv_usage: fraction of KV blocks in use, 0..1.
        num_free_blocks, num_total_blocks: KV blocks.
        num_preemptions: recompute preemptions since start.
        last_batch_size: sequences in the last step.
        last_num_batched_tokens: tokens fed in the last step.
        num_steps: steps that ran the model.
        prompt_tokens_total, generation_tokens_total: tokens since start
            (prompt tokens counted once per request; recompute not counted).
        batching: the batching mode.
        num_used_blocks: KV blocks referenced by a sequence
            (num_free_blocks + num_used_blocks = num_total_blocks).
        num_cached_blocks: free blocks still holding a reusable prefix block
            (a subset of num_free_blocks, evicted LRU when needed).
        fragmentation: allocated-but-unused token slots / allocated slots of
            used blocks, 0..1.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in
            the prefix cache at first admission, and those found (tokens).
        policy: the scheduling policy.
        spec_num_draft_tokens, spec_num_accepted_tokens: speculative decoding: draft
            tokens verified and accepted since start (vLLM's
            ``spec_decode_num_draft_tokens`` / ``..._accepted_tokens``).
    """

    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    last_batch_size: int
    last_num_batched_tokens: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
    batching: str
    num_used_blocks: int = 0
    num_cached_blocks: int = 0
    fragmentation: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    policy: str = "fcfs"
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def prefix_cache_hit_ratio(self) -> float:
        """prefix_cache_hits / prefix_cache_queries (0 when no query yet)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 when none was proposed yet)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0
