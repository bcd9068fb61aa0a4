"""Iteration-level scheduling over a paged KV cache.

Every step (continuous batching, Orca, Yu et al. OSDI'22): finished sequences
have left, running decodes are scheduled first (one token each), then
unfinished prefills, then waiting sequences join, all under a per-step token
budget (chunked prefill, Sarathi, Agrawal et al. OSDI'24) and ``max_num_seqs``.
Blocks are allocated on demand; when none is free, the lowest-priority, most
recently admitted running sequence is preempted by recompute (vLLM, Kwon et
al. SOSP'23): its blocks are freed and it returns to the front of the waiting
queue with its generated tokens, to re-prefill prompt + output later (reusing
whatever of it is still in the prefix cache).

Admission follows the policy's order (:mod:`worker.engine.policies`). A candidate
that does not fit the free blocks may be overtaken by later ones that do
(backfilling), unless it was preempted or has waited ``starvation_s`` seconds:
then admission stops until it fits, so a large request is never starved by a
stream of small ones, and blocks them only until running work frees room.

With speculative decoding on (:class:`~worker.engine.engine_config.SpeculativeConfig`),
a decoding sequence may feed its last token plus draft tokens proposed by n-gram
lookup, as one verification chunk; drafts never preempt anyone (they are proposed
only when the free blocks hold them) and are dropped above ``disable_by_batch_size``
decoding sequences. The engine accepts a prefix of them (:meth:`Scheduler.commit_draft`)
and gives back the blocks of the rest (:meth:`Scheduler.drop_drafts`).

Static and dynamic batching (see :mod:`worker.engine.request_batching`) reuse the same step
logic but admit only when the previous batch has fully finished.
"""

from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from worker.runner_io import ModelInput, ScheduledChunk
from worker.engine.request_batching import batch_deadline, batch_ready, worst_case_tokens
from worker.engine.block_manager import BlockManager
from worker.engine.engine_config import EngineConfig
from worker.engine.ngram_proposer import propose_ngram
from worker.engine.policies import make_policy
from worker.engine.sequence import Sequence, SequenceStatus


class Admission(enum.Enum):
    """Whether a new request can run here (answered once, by :meth:`Scheduler.admission`)."""

    START = "start"  # it can start now: a batch slot and the blocks its prompt needs are free
    WAIT = "wait"    # it fits once running requests finish and free their slots and blocks
    NEVER = "never"  # prompt + max_tokens exceed the context or the whole KV cache


@dataclass(frozen=True)
class AdmissionDecision:
    """The scheduler's answer for one request.

    Attributes:
        verdict: see :class:`Admission`.
        reason: why it can never run ("" unless ``verdict`` is NEVER).
    """

    verdict: Admission
    reason: str = ""


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's decision.

    Attributes:
        model_input: chunks to run (prefills then decodes).
        scheduled: the sequence of each chunk, in ``model_input.chunks`` order.
        preempted: sequences preempted (blocks freed) while scheduling.
    """

    model_input: ModelInput
    scheduled: list[Sequence]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        """Tokens fed to the model this step."""
        return self.model_input.num_tokens


@dataclass
class _Step:
    budget: int
    prefills: list[tuple[Sequence, ScheduledChunk]] = field(default_factory=list)
    decodes: list[tuple[Sequence, ScheduledChunk]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    scheduled_ids: set[int] = field(default_factory=set)
    speculate: bool = False


class Scheduler:
    """Decides, every step, which sequences run and how many tokens each feeds.

    Args:
        config: engine settings (budget, batch limits, batching mode, policy).
        block_manager: owns the KV blocks.
        max_model_len: context limit in tokens.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.prefix_queries = self.prefix_hits = 0  # tokens, first admissions only
        self.policy = make_policy(config)
        self._key = self.policy.key
        self._request_level = config.batching != "continuous"

    # ---- queue management ------------------------------------------------
    def never_fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run (None if it can): prompt + max_tokens
        beyond the context, or more blocks than the whole cache."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            return f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) exceeds the context length {self.max_model_len}"
        if self.bm.blocks_for(total) > self.bm.num_blocks:
            return f"prompt + max_tokens = {total} tokens needs more than the {self.bm.num_blocks} KV blocks of the cache"
        return None

    def admission(self, num_context_tokens: int, max_new_tokens: int) -> AdmissionDecision:
        """Can a new request start now, must it wait, or can it never run here?

        Args:
            num_context_tokens: tokens it prefills (prompt, plus a continuation's
                resumed output).
            max_new_tokens: tokens it may still generate.

        Continuous batching: it starts when a batch slot is free and the free blocks
        cover its context after what the waiting sequences need. Static/dynamic: when
        no batch runs, the forming batch has room, and the free blocks cover everyone's
        worst case (context + max_new_tokens), as request-level batchers reserve.
        """
        reason = self.never_fits(num_context_tokens, max_new_tokens)
        if reason:
            return AdmissionDecision(Admission.NEVER, reason)
        return AdmissionDecision(Admission.START if self._has_room(num_context_tokens, max_new_tokens)
                                 else Admission.WAIT)

    def _has_room(self, num_context_tokens: int, max_new_tokens: int) -> bool:
        bm, queued = self.bm, len(self.running) + len(self.waiting)
        if not self._request_level:
            need = bm.blocks_for(num_context_tokens) + sum(bm.blocks_for(s.num_uncomputed_tokens) for s in self.waiting)
            return queued < self.config.max_num_seqs and need <= bm.num_free_blocks
        if self.running or queued >= self.config.request_batch_size:
            return False
        worst = [s.num_prompt_tokens + s.params.max_tokens for s in self.waiting]
        worst.append(num_context_tokens + max_new_tokens)
        return sum(bm.blocks_for(min(w, self.max_model_len)) for w in worst) <= bm.num_free_blocks

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (callers ask :meth:`admission` first)."""
        bisect.insort(self.waiting, seq, key=self._key)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child``, a sibling choice of ``parent`` (parallel sampling) with the same
        tokens, on ``parent``'s KV blocks: they are shared by reference count and copied on
        the first write (:meth:`BlockManager.fork`), and ``child`` recomputes only its last
        token, for logits of its own. Falls back to queueing ``child`` (:meth:`add`; the
        prefix cache, when on, then serves its full blocks) in the request-level modes,
        when the batch is full, or when ``parent`` does not hold the tokens' KV."""
        n = child.num_tokens
        fits = not self._request_level and len(self.running) < self.config.max_num_seqs
        if not (fits and parent.num_computed_tokens >= n and child.token_ids == parent.token_ids[:n]
                and self.bm.fork(parent.seq_id, child.seq_id, n)):
            self.add(child)
            return
        child.num_computed_tokens = n - 1
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens  # the prompt was prefilled once
        child.set_status(SequenceStatus.RUNNING)
        self.running.append(child)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Move ``seq`` to an end state, drop it from the queues and free its
        blocks (also used for aborts)."""
        seq.set_status(status)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq.seq_id)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def next_batch_at(self) -> float | None:
        """Request-level modes: clock time when a waiting partial batch will
        start (None if none is pending or continuous batching)."""
        if not self._request_level or self.running:
            return None
        return batch_deadline(self.waiting, self.config.request_batch_size, self.config.max_wait_s)

    # ---- the step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks; "no room" shows as fewer chunks, never an
        exception."""
        step = _Step(budget=self.config.max_num_batched_tokens)
        spec = self.config.speculative
        step.speculate = spec is not None and spec.active(sum(s.is_decode for s in self.running))
        if self._request_level and not self.running:
            self._form_request_batch()
        self._schedule_running(step, decodes=True)
        self._schedule_running(step, decodes=False)
        if not self._request_level and not step.preempted:
            self._admit_waiting(step)
        return self._output(step)

    def on_executed(self, out: SchedulerOutput) -> None:
        """Record that the model ran ``out``: each chunk's tokens are cached (a
        verification chunk's draft tokens only once accepted: :meth:`commit_draft`)."""
        for seq, chunk in zip(out.scheduled, out.model_input.chunks):
            seq.num_computed_tokens += len(chunk.token_ids) - chunk.num_draft_tokens
            self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.lora_salt)

    def commit_draft(self, seq: Sequence) -> None:
        """An accepted draft token, just appended to ``seq``'s output: its KV, written
        by the verification pass, is now part of the computed context."""
        seq.num_computed_tokens += 1
        self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.lora_salt)

    def drop_drafts(self, seq: Sequence) -> None:
        """After verification: give back the blocks that only rejected drafts reached
        (their slots are beyond the computed context and are rewritten before read)."""
        self.bm.trim(seq.seq_id, seq.num_tokens)

    # ---- helpers -----------------------------------------------------------
    def _schedule_running(self, step: _Step, decodes: bool) -> None:
        for seq in list(self.running):
            if step.budget <= 0:
                return
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in step.scheduled_ids:
                continue
            if seq.is_decode != decodes:
                continue
            n = 1 if decodes else min(seq.num_uncomputed_tokens, step.budget, self.config.prefill_chunk_cap)
            drafts = self._drafts(seq, step) if decodes and step.speculate else []
            if self._reserve(seq, seq.num_computed_tokens + n + len(drafts), step):
                self._add_chunk(step, seq, n, drafts)

    def _drafts(self, seq: Sequence, step: _Step) -> list[int]:
        """Draft tokens for decoding ``seq`` this step: n-gram lookup, at most what
        its ``max_tokens``, the context, the step's budget and the free blocks leave
        room for (so drafts never preempt); [] for rows whose controls read the token
        history (penalties), that return logprobs or follow a grammar, and while ``seq`` backs off after
        failed verifications (:meth:`Sequence.record_verification`)."""
        spec, p = self.config.speculative, seq.params
        if p.penalizes or p.wants_logprobs or p.grammar is not None or seq.num_output_tokens < seq.spec_resume_at:
            return []
        room = min(spec.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1, step.budget - 1)
        if room < 1:
            return []
        drafts = propose_ngram(seq.token_ids, room, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if drafts and not self.bm.can_allocate(seq.num_computed_tokens + 1 + len(drafts), seq.seq_id):
            return []
        return drafts

    def _reserve(self, seq: Sequence, num_tokens: int, step: _Step) -> bool:
        """Grow ``seq``'s blocks to ``num_tokens``, preempting unscheduled
        sequences (lowest priority, then most recently admitted) until it
        fits. False when ``seq`` itself had to be preempted."""
        while not self.bm.allocate(seq.seq_id, num_tokens, write_from=seq.num_computed_tokens):
            unscheduled = (s for s in reversed(self.running) if s.seq_id not in step.scheduled_ids)
            victim = max(unscheduled, key=lambda s: s.priority)  # first max = most recent
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        seq.set_status(SequenceStatus.PREEMPTED)
        bisect.insort(self.waiting, seq, key=self._key)
        self.num_preemptions += 1
        step.preempted.append(seq)

    def _admit_waiting(self, step: _Step) -> None:
        for seq in self.policy.candidates(self.waiting):
            if len(self.running) >= self.config.max_num_seqs or step.budget <= 0:
                return
            n = self._claim(seq, min(step.budget, self.config.prefill_chunk_cap))
            if n is not None:
                self.policy.admitted(seq)
                self._start(seq)
                self._add_chunk(step, seq, n)
            elif self._holds_the_line(seq):
                return  # nobody overtakes it; running work will free blocks

    def _holds_the_line(self, seq: Sequence) -> bool:
        """True when ``seq`` must not be overtaken: it was preempted, or it
        has waited ``starvation_s`` seconds."""
        return seq.status is SequenceStatus.PREEMPTED or self.clock() - seq.arrival_time >= self.config.starvation_s

    def _claim(self, seq: Sequence, budget: int) -> int | None:
        """Give waiting ``seq`` its cached prefix plus blocks for its next
        chunk (request-level modes: for its worst case). Returns the chunk's
        tokens, or None ("no room", nothing changed)."""
        hits = self.bm.cached_prefix(seq.token_ids, seq.num_tokens - 1, seq.lora_salt)
        cached = len(hits) * self.bm.block_size
        n = min(seq.num_tokens - cached, budget)
        want = worst_case_tokens(seq, self.max_model_len) if self._request_level else cached + n
        if not self.bm.allocate(seq.seq_id, want, hits):
            return None
        seq.num_computed_tokens = cached
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = cached
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += cached
        return n

    def _form_request_batch(self) -> None:
        size = self.config.request_batch_size
        if not batch_ready(self.waiting, size, self.config.max_wait_s, self.clock()):
            return
        for seq in list(self.waiting[:size]):
            if self._claim(seq, self.config.max_num_batched_tokens) is None:
                return
            self._start(seq)

    def _start(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.set_status(SequenceStatus.RUNNING)
        self.running.append(seq)

    def _add_chunk(self, step: _Step, seq: Sequence, n: int, drafts: list[int] | None = None) -> None:
        start = seq.num_computed_tokens
        chunk = ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(start, start + n) + (drafts or []),
            start_pos=start,
            block_table=self.bm.block_table(seq.seq_id),
            needs_logits=start + n == seq.num_tokens,
            num_draft_tokens=len(drafts or ()),
            lora_id=seq.lora_id,
        )
        (step.decodes if seq.is_decode and not drafts else step.prefills).append((seq, chunk))
        step.budget -= len(chunk.token_ids)
        step.scheduled_ids.add(seq.seq_id)

    def _output(self, step: _Step) -> SchedulerOutput:
        pairs = step.prefills + step.decodes
        model_input = ModelInput(prefills=[c for _, c in step.prefills], decodes=[c for _, c in step.decodes],
                                 blocks_to_copy=self.bm.take_copies())
        return SchedulerOutput(model_input=model_input, scheduled=[s for s, _ in pairs], preempted=step.preempted)
