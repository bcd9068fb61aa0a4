"""Engine settings: one frozen dataclass, built once at the entry point and
passed in (no environment reads here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

BatchingMode = Literal["continuous", "static", "dynamic"]
BATCHING_MODES: tuple[str, ...] = ("continuous", "static", "dynamic")
POLICIES: tuple[str, ...] = ("fcfs", "sjf", "fair")

#: Request-level batch sizes from the source article (static 8, dynamic 32).
DEFAULT_MAX_BATCH_SIZE = {"static": 8, "dynamic": 32}


SPECULATIVE_METHODS: tuple[str, ...] = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding without a draft model (vLLM's ``--speculative-config``
    keys for ``method: "ngram"``).

    Attributes:
        method: "ngram": drafts by prompt lookup (:mod:`worker.engine.ngram_proposer`).
        num_speculative_tokens: most draft tokens verified per sequence and step (k).
        prompt_lookup_max, prompt_lookup_min: n-gram lengths looked up, longest first.
        disable_by_batch_size: speculate only while at most this many sequences
            decode; above it a step's verification tokens cost more throughput
            than the accepted tokens return (bench/spec_decode.py measures the
            crossover). 0 = always.

    Raises:
        ValueError: on an unknown method or out-of-range value.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        _check(self.method in SPECULATIVE_METHODS, f"speculative method must be one of {SPECULATIVE_METHODS}")
        _check(self.num_speculative_tokens >= 1, "num_speculative_tokens must be >= 1")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max")
        _check(self.disable_by_batch_size >= 0, "disable_by_batch_size must be >= 0")

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig | None":
        """Parse ``--speculative-config`` (a JSON object; ``""`` or ``null`` = off).

        Raises:
            ValueError: not JSON, not an object, an unknown key, or a bad value.
        """
        if not text.strip():
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    def active(self, num_decodes: int) -> bool:
        """True when a step with ``num_decodes`` decoding sequences speculates."""
        return not self.disable_by_batch_size or num_decodes <= self.disable_by_batch_size


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the engine core (scheduler, block manager, sampler).

    Attributes:
        block_size: tokens per KV block; must equal the runner's block_size.
        num_blocks: KV blocks to manage; None = the runner's ``num_blocks``.
        max_num_seqs: most sequences in one step (continuous batching).
        max_num_batched_tokens: per-step token budget (decode tokens + prefill
            chunk tokens); prefills longer than what is left are chunked.
        long_prefill_token_threshold: most prompt tokens one sequence may
            prefill in a step (0 = no cap beyond the budget), so a long prompt
            leaves budget for shorter ones admitted beside it: they reach their
            first token while it is still prefilling (vLLM's option of that name).
        batching: "continuous" (iteration-level, Orca, Yu et al. OSDI'22),
            "static" (wait for ``max_batch_size`` requests, run to completion)
            or "dynamic" (``max_batch_size`` or ``max_wait_ms``, whichever
            comes first, run to completion).
        max_batch_size: request-level batch size; None = 8 (static) / 32
            (dynamic). Unused by continuous batching.
        max_wait_ms: dynamic batching: milliseconds after the first waiting
            request's arrival before a partial batch starts.
        policy: admission order of waiting work (see :mod:`worker.engine.policies`):
            "fcfs" (first come, first served), "sjf" (shortest expected work,
            prompt + max_tokens, first, with aging) or "fair" (deficit round
            robin over tenants). Request priority (0 = highest) always comes
            first, then preempted sequences.
        enable_prefix_caching: reuse cached full KV blocks of equal prefixes
            (vLLM automatic prefix caching; SGLang RadixAttention idea).
        prefix_cache_salt: model/adapter identity mixed into block hashes.
        enable_kv_events: record the prefix cache's stored/removed block hashes for
            :meth:`LLMEngine.take_kv_events` (vLLM's ``enable_kv_cache_events``; the worker
            publishes them for the gateway's KV-aware routing). Off: nothing is kept.
        sjf_aging_tokens_per_s: sjf aging rate: a waiting request's expected
            cost (tokens) shrinks by this many tokens per second waited, so a
            request of cost C is overtaken by no request arriving more than
            C / rate seconds after it.
        fair_quantum_tokens: fair: tokens of admission credit each tenant
            gets per deficit-round-robin visit (Shreedhar & Varghese SIGCOMM'95);
            small (about two blocks) so a tenant admits few requests per visit.
        starvation_s: seconds a waiting request may be overtaken by smaller
            ones that fit (backfilling) while it does not fit the free
            blocks; past it, admission stops until it fits.
        max_model_len: context limit in tokens; None = the runner's
            ``context_length``.
        speculative: speculative decoding settings; None = off.
        enable_lora: serve LoRA adapters (vLLM's ``--enable-lora``): requests may name one
            (:meth:`LLMEngine.add_lora`, :mod:`worker.engine.lora_registry`).
        max_loras: most adapters loaded at once, hence in one step (vLLM's ``--max-loras``);
            loading another evicts the least recently used one no unfinished request uses.

    Raises:
        ValueError: on any out-of-range value (from ``__post_init__``).
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    batching: BatchingMode = "continuous"
    max_batch_size: int | None = None
    max_wait_ms: float = 5.0
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    prefix_cache_salt: str = ""
    enable_kv_events: bool = False
    sjf_aging_tokens_per_s: float = 64.0
    fair_quantum_tokens: int = 32
    starvation_s: float = 2.0
    max_model_len: int | None = None
    speculative: SpeculativeConfig | None = None
    enable_lora: bool = False
    max_loras: int = 1

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, "block_size must be >= 1")
        _check(self.num_blocks is None or self.num_blocks >= 1, "num_blocks must be >= 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0")
        _check(self.batching in BATCHING_MODES, f"batching must be one of {BATCHING_MODES}")
        _check(self.max_batch_size is None or self.max_batch_size >= 1, "max_batch_size must be >= 1")
        _check(self.max_wait_ms >= 0, "max_wait_ms must be >= 0")
        _check(self.policy in POLICIES, f"policy must be one of {POLICIES}")
        _check(self.sjf_aging_tokens_per_s >= 0, "sjf_aging_tokens_per_s must be >= 0")
        _check(self.fair_quantum_tokens >= 1, "fair_quantum_tokens must be >= 1")
        _check(self.starvation_s >= 0, "starvation_s must be >= 0")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        _check(self.max_loras >= 1, "max_loras must be >= 1")

    @property
    def prefill_chunk_cap(self) -> int:
        """Most prompt tokens one sequence prefills in a step: the long-prefill
        threshold when set, else the whole budget."""
        return self.long_prefill_token_threshold or self.max_num_batched_tokens

    @property
    def request_batch_size(self) -> int:
        """Batch size of request-level batching (static/dynamic); for
        continuous batching, ``max_num_seqs``."""
        if self.batching == "continuous":
            return self.max_num_seqs
        return self.max_batch_size or DEFAULT_MAX_BATCH_SIZE[self.batching]

    @property
    def max_wait_s(self) -> float:
        """Seconds a partial request-level batch waits: ``inf`` for static
        batching (it waits for a full batch), ``max_wait_ms / 1000`` for dynamic."""
        return float("inf") if self.batching == "static" else self.max_wait_ms / 1000.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
