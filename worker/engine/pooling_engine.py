"""The pooling engine (``--runner pooling``): embeddings requests in, one pooled vector each out.

It stands where :class:`~worker.engine.engine.LLMEngine` stands for the worker service
(``add_request``, ``abort``, ``step``, ``has_unfinished``, ``admission``, ``stats``), so the
queue, link, deadline, cancel and drain lifecycle of worker/serve/ is the same for both. A
request is prefill only: its prompt goes through the model over the paged KV cache (the KV
is written, as attention over a long prompt's later chunks needs it), in chunks of at most
the per-step token budget, many prompts per step; the final-norm hidden states its pooling
reads are kept (worker/engine/pooler.py); once its last chunk ran, its blocks go back to the
free list at once and it finishes with an :class:`EmbeddingOutput`. Nothing is ever sampled.

Generation requests (no ``pooling``) are refused as INVALID with a message saying which
worker serves them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from worker.engine.engine_config import EngineConfig
from worker.engine.engine_types import (AddResult, AddStatus, EmbeddingOutput, EngineLoad, EngineRequest,
                                        EngineStats, RequestOutput)
from worker.engine.pooler import PooledState, PoolerConfig, finish_embedding
from worker.engine.scheduler import Admission, AdmissionDecision
from worker.runner_io import ModelInput, ScheduledChunk

log = logging.getLogger(__name__)

#: Why a pooling engine refuses a generation request (the client gets it as a 400).
NOT_A_GENERATING_ENGINE = ("this worker serves embeddings only (--runner pooling): completions and chat "
                           "requests are served by workers started with --runner generate")


@dataclass
class _Job:
    """One embeddings request in the engine: its prompt, the next position to prefill, its
    KV blocks (held until its last chunk ran) and its pooling so far."""

    request_id: str
    prompt: list[int]
    dimensions: int
    normalize: bool
    blocks: list[int]
    state: PooledState
    arrival: float
    pos: int = 0
    seq_id: int = 0
    done_rows: list[int] = field(default_factory=list)


class PoolingEngine:
    """Embeddings over the paged KV cache, prefill only.

    Args:
        runner: a :class:`~worker.model.model_runner.ModelRunner` (``hidden_states``,
            ``num_blocks``, ``block_size``, ``vocab_size``, ``context_length``,
            ``config.hidden_size``).
        tokenizer: the model's tokenizer (kept for the worker service; not used here).
        config: engine settings: ``max_num_seqs`` (requests at once),
            ``max_num_batched_tokens`` (prompt tokens per step), ``block_size``, ``num_blocks``,
            ``max_model_len``.
        pooler: the pooling type and normalization.
        clock: seconds, monotonic.
    """

    def __init__(self, runner: Any, tokenizer: Any, config: EngineConfig | None = None,
                 pooler: PoolerConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        config = config or EngineConfig(block_size=runner.block_size)
        if config.block_size != runner.block_size:
            raise ValueError(f"config.block_size {config.block_size} != runner.block_size {runner.block_size}")
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.pooler = pooler or PoolerConfig()
        self.clock = clock
        self.max_model_len = min(config.max_model_len or runner.context_length, runner.context_length)
        self.hidden_size = runner.config.hidden_size
        self.num_blocks = min(config.num_blocks or runner.num_blocks, runner.num_blocks)
        self._free = list(range(self.num_blocks))
        self._jobs: dict[str, _Job] = {}
        self._order: deque[str] = deque()  # request ids, oldest first
        self._pending: list[RequestOutput | EmbeddingOutput] = []
        self._next_seq = 0
        self._num_steps = self._prompt_tokens = 0
        self._last_batch = self._last_tokens = 0

    # ---- requests ------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def add_request(self, request: EngineRequest, only_if_room: bool = False) -> AddResult:
        """Take an embeddings request. Never raises for a bad one: INVALID (a generation
        request, an empty prompt, a token outside the vocabulary, ``dimensions`` above the
        hidden size), NEVER_FITS (longer than the context or the whole KV cache), DUPLICATE;
        with ``only_if_room`` NO_ROOM while the batch is full or its blocks are not free."""
        problem = self._invalid(request)
        if problem:
            return AddResult(AddStatus.INVALID, problem)
        if request.request_id in self._jobs:
            return AddResult(AddStatus.DUPLICATE, f"request {request.request_id!r} is already running")
        verdict = self.admission(len(request.prompt_token_ids), 0)
        if verdict.verdict is Admission.NEVER:
            return AddResult(AddStatus.NEVER_FITS, verdict.reason)
        if verdict.verdict is Admission.WAIT:
            if only_if_room:
                return AddResult(AddStatus.NO_ROOM, "no free batch slot or KV blocks yet")
        prompt = list(request.prompt_token_ids)
        job = _Job(request.request_id, prompt, request.pooling.dimensions, request.pooling.normalize, [],
                   PooledState(self.pooler, len(prompt)),
                   self.clock() if request.arrival_time is None else request.arrival_time, seq_id=self._next_seq)
        self._next_seq += 1
        self._jobs[job.request_id] = job
        self._order.append(job.request_id)
        return AddResult(AddStatus.ACCEPTED)

    def _invalid(self, request: EngineRequest) -> str | None:
        if request.pooling is None:
            return NOT_A_GENERATING_ENGINE
        if not request.prompt_token_ids:
            return "the input is empty"
        if any(not 0 <= t < self.runner.vocab_size for t in request.prompt_token_ids):
            return f"input token ids must be in [0, {self.runner.vocab_size})"
        dims = request.pooling.dimensions
        if dims < 0 or dims > self.hidden_size:
            return f"dimensions must be in [1, {self.hidden_size}] (the model's embedding size), got {dims}"
        return None

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks now; its "abort" output comes with the next
        :meth:`step`. False when unknown."""
        job = self._jobs.pop(request_id, None)
        if job is None:
            return False
        self._order.remove(request_id)
        self._release(job)
        self._pending.append(RequestOutput(request_id, "", [], True, "abort", len(job.prompt), 0))
        return True

    def has_unfinished(self) -> bool:
        """True while requests wait or run (or an abort output is pending)."""
        return bool(self._jobs or self._pending)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of the requests not answered yet, oldest first."""
        return list(self._order)

    # ---- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput | EmbeddingOutput]:
        """Prefill the next chunks of the oldest requests within the token budget (each
        request's blocks taken when its first chunk runs), pool what they read, and answer
        every request whose prompt is done. A runner failure finishes the step's requests
        with "error"."""
        outputs, self._pending = self._pending, []
        chunks, jobs, rows, owners = self._schedule()
        if not chunks:
            return outputs
        self._last_batch, self._last_tokens = len(chunks), sum(len(c.token_ids) for c in chunks)
        try:
            hidden = self.runner.hidden_states(ModelInput(prefills=chunks), rows)
        except Exception:  # noqa: BLE001 - a runner failure fails its requests, not the worker
            log.exception("pooling step failed")
            for job in jobs:
                self._drop(job)
                outputs.append(RequestOutput(job.request_id, "", [], True, "error", len(job.prompt), 0))
            return outputs
        self._num_steps += 1
        for i, job in enumerate(jobs):
            job.state.add(hidden[[r for r, owner in enumerate(owners) if owner == i]])
            job.pos += len(chunks[i].token_ids)
            if job.pos < len(job.prompt):
                continue
            self._drop(job)
            self._prompt_tokens += len(job.prompt)
            try:
                values = finish_embedding(job.state.pooled(), job.dimensions, job.normalize and self.pooler.normalize)
            except (ValueError, RuntimeError) as exc:
                log.warning("request %s: %s", job.request_id, exc)
                outputs.append(RequestOutput(job.request_id, "", [], True, "error", len(job.prompt), 0))
                continue
            outputs.append(EmbeddingOutput(job.request_id, values, len(job.prompt)))
        return outputs

    def _schedule(self) -> tuple[list[ScheduledChunk], list[_Job], list[int], list[int]]:
        """This step's chunks (oldest request first, at most ``max_num_seqs`` of them and
        ``max_num_batched_tokens`` tokens), their jobs, the batch rows to return and which
        chunk each row belongs to. A request whose blocks are not free waits (FIFO)."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        jobs: list[_Job] = []
        rows: list[int] = []
        owners: list[int] = []
        offset = 0
        for rid in list(self._order):
            if budget <= 0 or len(chunks) >= self.config.max_num_seqs:
                break
            job = self._jobs[rid]
            if not job.blocks:
                need = self._blocks_for(len(job.prompt))
                if need > len(self._free):
                    break  # FIFO: later requests wait behind it
                job.blocks, self._free = self._free[:need], self._free[need:]
            take = min(budget, len(job.prompt) - job.pos)
            tokens = job.prompt[job.pos:job.pos + take]
            chunks.append(ScheduledChunk(job.seq_id, tokens, job.pos, job.blocks, needs_logits=False))
            for position in self.pooler.rows(job.pos, job.pos + take, len(job.prompt)):
                rows.append(offset + position - job.pos)
                owners.append(len(jobs))
            jobs.append(job)
            offset += take
            budget -= take
        return chunks, jobs, rows, owners

    def _drop(self, job: _Job) -> None:
        """Forget a finished (or failed) request and free its blocks."""
        self._jobs.pop(job.request_id, None)
        self._order.remove(job.request_id)
        self._release(job)

    def _release(self, job: _Job) -> None:
        self._free.extend(job.blocks)
        job.blocks = []

    # ---- admission and stats -----------------------------------------------------
    def admission(self, num_context_tokens: int, max_new_tokens: int) -> AdmissionDecision:
        """START when a batch slot is free and the blocks of ``num_context_tokens`` tokens are
        not promised to the requests already taken; WAIT otherwise; NEVER beyond the context
        or the whole cache (``max_new_tokens`` is ignored: nothing is generated)."""
        need = self._blocks_for(num_context_tokens)
        if num_context_tokens > self.max_model_len:
            return AdmissionDecision(Admission.NEVER, f"the input has {num_context_tokens} tokens; this model "
                                     f"takes at most {self.max_model_len}")
        if need > self.num_blocks:
            return AdmissionDecision(Admission.NEVER, f"the input needs {need} KV blocks; the cache has "
                                     f"{self.num_blocks}")
        promised = sum(self._blocks_for(len(j.prompt)) for j in self._jobs.values() if not j.blocks)
        if len(self._jobs) >= self.config.max_num_seqs or need > len(self._free) - promised:
            return AdmissionDecision(Admission.WAIT)
        return AdmissionDecision(Admission.START)

    def next_batch_at(self) -> float | None:
        """None: a pooling engine never waits to form a batch."""
        return None

    def load(self) -> EngineLoad:
        """Requests running (blocks taken) and waiting, and free KV blocks."""
        running = sum(1 for j in self._jobs.values() if j.blocks)
        return EngineLoad(running, len(self._jobs) - running, len(self._free), self.num_blocks)

    def stats(self) -> EngineStats:
        """A snapshot for the worker's metrics (no prefix cache, no generation)."""
        load = self.load()
        used = self.num_blocks - load.num_free_blocks
        return EngineStats(
            num_running=load.num_running, num_waiting=load.num_waiting,
            kv_usage=used / self.num_blocks if self.num_blocks else 0.0,
            num_free_blocks=load.num_free_blocks, num_total_blocks=self.num_blocks, num_preemptions=0,
            last_batch_size=self._last_batch, last_num_batched_tokens=self._last_tokens,
            num_steps=self._num_steps, prompt_tokens_total=self._prompt_tokens, generation_tokens_total=0,
            batching="pooling", num_used_blocks=used)
