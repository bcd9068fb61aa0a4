"""The engine loop: schedule → run the model → sample → update sequences.

Driven from one thread: the worker service calls :meth:`LLMEngine.add_request`,
:meth:`LLMEngine.abort` and :meth:`LLMEngine.step` in turn; no locks inside.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Callable

from worker.engine.block_manager import BlockManager
from worker.engine.engine_config import EngineConfig
from worker.engine.parallel_sampling import ForkQueue, choice_params
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.grammar import GrammarCompiler, GrammarRuntime
from worker.engine.engine_types import AddResult, AddStatus, EngineLoad, EngineRequest, EngineStats, RequestOutput
from worker.engine.lora_registry import LoraEntry, LoraNoRoom, LoraRegistry
from worker.engine.prefix_cache import KVEvents
from worker.engine.rejection_sampler import accept_greedy, accept_sampled
from worker.engine.sampler import Sampler, TokenLogprob
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Admission, AdmissionDecision, Scheduler, SchedulerOutput
from worker.engine.sequence import Sequence, SequenceStatus
from worker.runner_io import ScheduledChunk

__all__ = ["LLMEngine", "EngineRequest", "AddResult", "AddStatus", "Admission", "RequestOutput", "EngineStats"]

log = logging.getLogger(__name__)

#: Why a generating engine refuses an embeddings request (the gateway's client gets it as a 400).
NOT_A_POOLING_ENGINE = ("this worker generates text (--runner generate): embeddings requests are served by "
                        "workers started with --runner pooling")
#: Seconds a step with nothing to run waits for a grammar compile to finish.
GRAMMAR_POLL_S = 0.005


class LLMEngine:
    """Continuous (or static/dynamic) batching engine over a paged KV cache.

    Args:
        runner: has ``execute(ModelInput) -> ModelOutput`` and attrs
            ``num_blocks``, ``block_size``, ``vocab_size``, ``context_length``.
        tokenizer: has ``decode(ids, skip_special_tokens)`` and
            ``eos_token_ids`` (see CONTRACTS.md).
        config: engine settings.
        clock: seconds, monotonic (injectable for tests).
        sampler: a :class:`Sampler` (injectable for tests).

    Raises:
        ValueError: when config.block_size differs from the runner's, or
            config.num_blocks exceeds the runner's.
    """

    def __init__(self, runner: Any, tokenizer: Any, config: EngineConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sampler: Sampler | None = None) -> None:
        config = config or EngineConfig(block_size=runner.block_size)
        if config.block_size != runner.block_size:
            raise ValueError(f"config.block_size {config.block_size} != runner.block_size {runner.block_size}")
        num_blocks = config.num_blocks or runner.num_blocks
        if num_blocks > runner.num_blocks:
            raise ValueError(f"config.num_blocks {num_blocks} > runner.num_blocks {runner.num_blocks}")
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or runner.context_length, runner.context_length)
        salt = f"{config.prefix_cache_salt}|{getattr(runner, 'model_name', type(runner).__name__)}"
        #: The salt of this engine's block hashes (common/block_hash.py): the gateway's router
        #: needs it, with the block size, to compute the same hashes of a prompt.
        self.block_hash_salt = salt
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, salt,
                                          record_events=config.enable_kv_events)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len, clock)
        self.sampler = sampler or Sampler()
        self.grammars = GrammarRuntime(GrammarCompiler(tokenizer, runner.vocab_size))  # structured outputs
        self.clock = clock
        self._eos = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its unfinished choices
        self._forks = ForkQueue()  # choices 1..n-1 waiting for choice 0's prefill
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._last: SchedulerOutput | None = None
        self._num_steps = self._prompt_tokens = self._generation_tokens = 0
        self._num_draft_tokens = self._num_accepted_tokens = 0  # speculative decoding
        #: LoRA adapters (None: --enable-lora off), and the adapter each unfinished request holds
        self.loras = LoraRegistry(runner, config.max_loras) if config.enable_lora else None
        self._lora_holds: dict[str, int] = {}

    # ---- requests ------------------------------------------------------------
    def add_request(self, request: EngineRequest, only_if_room: bool = False) -> AddResult:
        """Queue a request. Never raises for a bad request: returns INVALID,
        DUPLICATE or NEVER_FITS (prompt + max_tokens beyond the context or the whole
        KV cache) with a message; with ``only_if_room``, NO_ROOM when it could not
        start at once (the scheduler's :meth:`~Scheduler.admission` says WAIT), so a
        worker leaves it in its queue instead of holding it here."""
        if request.request_id in self._groups:
            return AddResult(AddStatus.DUPLICATE, f"request {request.request_id!r} is already running")
        problem = self._invalid(request)
        if problem:
            return AddResult(AddStatus.INVALID, problem)
        resumed = len(request.resumed_token_ids)
        decision = self.scheduler.admission(len(request.prompt_token_ids) + resumed,
                                            request.sampling_params.max_tokens - resumed)
        if decision.verdict is Admission.NEVER:
            return AddResult(AddStatus.NEVER_FITS, decision.reason)
        if only_if_room and decision.verdict is Admission.WAIT:
            return AddResult(AddStatus.NO_ROOM, "no free batch slot or KV blocks yet")
        arrival = self.clock() if request.arrival_time is None else request.arrival_time
        lora, refused = self._acquire_lora(request.lora_name)
        if refused is not None:
            return refused
        try:
            choices = [self._new_sequence(request, index, arrival, lora) for index in range(request.n)]
        except ValueError as exc:
            if lora is not None:
                self.loras.release(lora.lora_id)
            return AddResult(AddStatus.INVALID, str(exc))
        if lora is not None:
            self._lora_holds[request.request_id] = lora.lora_id
        for seq, detok in choices:
            self._detok[seq.seq_id] = detok
        group = [seq for seq, _ in choices]
        self._groups[request.request_id] = group
        if request.sampling_params.grammar is not None:  # joins the scheduler once compiled
            self.grammars.wait(request.request_id, request.sampling_params.grammar, group,
                               request.resumed_token_ids)
        else:
            self.scheduler.add(group[0])
        self._forks.hold(group[0], group[1:])
        return AddResult(AddStatus.ACCEPTED)

    def _new_sequence(self, request: EngineRequest, index: int, arrival: float,
                      lora: LoraEntry | None = None) -> tuple[Sequence, IncrementalDetokenizer]:
        """Choice ``index`` of ``request`` and its detokenizer (run with ``lora``, None = the base model).

        Raises:
            ValueError: the resumed tokens and text disagree.
        """
        params = choice_params(request.sampling_params, index)
        seq = Sequence(next(self._ids), request.request_id, list(request.prompt_token_ids), params,
                       arrival_time=arrival, tenant=request.tenant, priority=request.priority,
                       output_token_ids=list(request.resumed_token_ids),
                       num_resumed_tokens=len(request.resumed_token_ids), index=index,
                       lora_id=lora.lora_id if lora else 0, lora_salt=lora.salt if lora else "")
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop, params.skip_special_tokens)
        detok.resume(request.resumed_token_ids, request.resumed_text)
        return seq, detok

    def _invalid(self, request: EngineRequest) -> str | None:
        if request.pooling is not None:
            return NOT_A_POOLING_ENGINE
        if not request.prompt_token_ids:
            return "the prompt is empty"
        if any(not 0 <= t < self.runner.vocab_size for t in request.prompt_token_ids):
            return f"prompt token ids must be in [0, {self.runner.vocab_size})"
        try:
            request.sampling_params.validate(self.runner.vocab_size)
        except ValueError as exc:
            return str(exc)
        if any(not 0 <= t < self.runner.vocab_size for t in request.resumed_token_ids):
            return f"resumed token ids must be in [0, {self.runner.vocab_size})"
        if len(request.resumed_token_ids) >= request.sampling_params.max_tokens:
            return "a continuation must leave at least one token of max_tokens to generate"
        if not isinstance(request.n, int) or request.n < 1:
            return f"n must be an integer >= 1, got {request.n!r}"
        grammar = request.sampling_params.grammar
        if grammar is not None and grammar.error:
            return grammar.error
        if request.n > 1 and request.resumed_token_ids:
            return "a continuation carries one choice (n = 1)"
        return None

    def abort(self, request_id: str) -> bool:
        """Finish a request with "abort" and free its blocks now; its final
        output comes with the next :meth:`step`. Returns False if unknown."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        self.grammars.drop(request_id)
        for seq in list(group):
            self._forks.release(seq)  # held siblings are in the group too: finished below
            self._pending.append(self._finish(seq, SequenceStatus.FINISHED_ABORTED, "", []))
        return True

    def has_unfinished(self) -> bool:
        """True while requests wait or run (or an abort output is pending)."""
        return bool(self._groups or self._pending)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of the requests that still wait or run (at least one unfinished choice), in
        the order they were added; e.g. to :meth:`abort` them all."""
        return list(self._groups)

    @property
    def last_schedule(self) -> SchedulerOutput | None:
        """What the most recent :meth:`step` scheduled (its ``model_input`` is what the
        runner was given; ``is_empty`` when nothing ran); None before the first step."""
        return self._last

    # ---- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs only for requests with new text,
        tokens or a finish. Runner failures finish the batch with "error"."""
        outputs, self._pending = self._pending, []
        outputs += self._start_compiled()
        sched = self.scheduler.schedule()
        self._last = sched
        if sched.is_empty:
            if not outputs:
                self.grammars.wait_any(GRAMMAR_POLL_S)  # nothing to run but a compile
            return outputs
        pairs = [(s, c) for s, c in zip(sched.scheduled, sched.model_input.chunks) if c.needs_logits]
        rows = [s for s, c in pairs for _ in range(c.num_logits)]
        try:
            model_output = self.runner.execute(sched.model_input)
            if list(model_output.seq_ids) != [s.seq_id for s in rows]:
                raise RuntimeError(f"runner returned rows for {model_output.seq_ids}, expected {[s.seq_id for s in rows]}")
        except Exception:  # the runner's failure must not kill the worker
            log.exception("model runner failed; finishing %d sequences with 'error'", len(sched.scheduled))
            failed = [s for seq in sched.scheduled for s in (seq, *self._forks.release(seq))]
            return outputs + [self._finish(s, SequenceStatus.FINISHED_ERROR, "", []) for s in failed]
        self._num_steps += 1
        self.scheduler.on_executed(sched)
        indices = [s.num_output_tokens + j for s, c in pairs for j in range(c.num_logits)]
        params = [s.params for s in rows]
        history = any(p.penalizes for p in params)  # the penalties read every row's tokens
        sample = self.sampler(model_output.logits, params, indices,
                              [s.prompt_token_ids for s in rows] if history else None,
                              [s.output_token_ids for s in rows] if history else None, self._eos,
                              self.grammars.bitmask([s.seq_id for s in rows]))
        row = 0
        for seq, chunk in pairs:
            if not chunk.num_draft_tokens:
                outputs.append(self._append_token(seq, sample.token_ids[row], sample.logprobs[row]))
            else:
                span = slice(row, row + chunk.num_logits)
                tokens = self._verify(chunk, model_output.logits[span], params[span], indices[span],
                                      sample.token_ids[span])
                outputs.append(self._append_verified(seq, tokens))
            row += chunk.num_logits
        return outputs

    def _start_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar compiled join the scheduler (their first choice; the
        others follow its prefill); those whose grammar failed finish with "error"."""
        outputs = []
        for _request_id, seqs, error in self.grammars.ready():
            if not error:
                self.scheduler.add(seqs[0])
                continue
            log.warning("request %s: %s", seqs[0].request_id, error)
            for seq in seqs:
                self._forks.release(seq)
                outputs.append(self._finish(seq, SequenceStatus.FINISHED_ERROR, "", [],
                                            error=f"the structured output's grammar failed: {error}"))
        return outputs

    def _verify(self, chunk: ScheduledChunk, logits: Any, params: list[SamplingParams], indices: list[int],
                sampled: list[int]) -> list[int]:
        """The tokens a verification chunk emits (:mod:`worker.engine.rejection_sampler`):
        ``logits`` [1 + k, V] are its rows, ``sampled`` the sampler's token for each
        (the argmax of a greedy row)."""
        drafts = chunk.token_ids[-chunk.num_draft_tokens:]
        self._num_draft_tokens += len(drafts)
        if params[0].temperature <= 0:
            tokens = accept_greedy(sampled, drafts)
        else:
            probs = self.sampler.probabilities(logits, params, indices, self._eos)
            draws = self.sampler.uniforms(params, [2 * i for i in indices])  # seeded: per (seed, index)
            resample = float(self.sampler.uniforms(params[:1], [2 * indices[len(drafts)] + 1])[0])
            tokens = accept_sampled(probs, drafts, draws[:-1], resample, sampled[-1])
        self._num_accepted_tokens += len(tokens) - 1
        return tokens

    def _append_verified(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append the accepted drafts and the final token of a verification, stopping at
        the first that finishes ``seq``; one output carrying them all."""
        parts = []
        for i, token in enumerate(tokens):
            parts.append(self._append_token(seq, token, None))
            if seq.is_finished:
                break
            if i < len(tokens) - 1:
                self.scheduler.commit_draft(seq)
        if not seq.is_finished:
            self.scheduler.drop_drafts(seq)
            seq.record_verification(len(tokens) - 1)
        last = parts[-1]
        return dataclasses.replace(last, text_delta="".join(p.text_delta for p in parts),
                                   token_ids=[t for p in parts for t in p.token_ids])

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        if seq.num_output_tokens == seq.num_resumed_tokens:  # this engine's first sample
            if seq.index == 0:
                self._prompt_tokens += seq.num_prompt_tokens  # once per request, whatever n
            for sibling in self._forks.release(seq):  # the prompt's KV is in place: they share its blocks
                self.scheduler.fork(seq, sibling)
        seq.output_token_ids.append(token)
        grammar, grammar_error = self.grammars.advance(seq.seq_id, token)
        if grammar == "error":  # the grammar engine failed (its lexer's budget, say); never emit text that breaks it
            log.error("request %s: %s", seq.request_id, grammar_error)
            return self._finish(seq, SequenceStatus.FINISHED_ERROR, "", [token],
                                error=f"the structured output's grammar failed while generating: {grammar_error}")
        self._generation_tokens += 1
        p = seq.params
        end = None
        delta = ""
        if token in p.stop_token_ids or (not p.ignore_eos and token in self._eos):
            end = SequenceStatus.FINISHED_STOPPED  # the stop token's text is not emitted
        else:
            update = self._detok[seq.seq_id].add_token(token)
            delta = update.text_delta
            if update.stopped:
                end = SequenceStatus.FINISHED_STOPPED
            elif grammar == "done":  # the output is complete: nothing but EOS could follow
                end = SequenceStatus.FINISHED_STOPPED
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                end = SequenceStatus.FINISHED_LENGTH
        logprobs = [logprob] if logprob is not None else None
        if end is not None:
            return self._finish(seq, end, delta, [token], logprobs)
        return self._output(seq, delta, [token], logprobs)

    def _finish(self, seq: Sequence, status: SequenceStatus, delta: str, tokens: list[int],
                logprobs: list[TokenLogprob] | None = None, error: str = "") -> RequestOutput:
        """End ``seq`` with ``status``; its last output. ``error`` (with FINISHED_ERROR): the
        client's message, sent as an ``invalid_request`` (the request's grammar failed)."""
        if status is not SequenceStatus.FINISHED_ABORTED and status is not SequenceStatus.FINISHED_ERROR:
            delta += self._detok[seq.seq_id].flush()
        self.scheduler.finish(seq, status)
        group = self._groups[seq.request_id]
        group.remove(seq)
        if not group:
            del self._groups[seq.request_id]
            if seq.request_id in self._lora_holds:
                self.loras.release(self._lora_holds.pop(seq.request_id))
        del self._detok[seq.seq_id]
        self.grammars.release(seq.seq_id)
        out = self._output(seq, delta, tokens, logprobs)
        return dataclasses.replace(out, error=error, error_code="invalid_request") if error else out

    @staticmethod
    def _output(seq: Sequence, delta: str, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        return RequestOutput(seq.request_id, delta, tokens, seq.is_finished, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_prompt_tokens, logprobs,
                             seq.index)

    # ---- LoRA adapters ---------------------------------------------------------
    def lora_names(self) -> list[str]:
        """The LoRA adapters requests may name (registered, loaded or not; [] when
        ``enable_lora`` is off): what the worker announces."""
        return self.loras.names() if self.loras is not None else []

    def lora_salts(self) -> dict[str, str]:
        """Each served adapter's identity in the prefix cache's block hashes (``name@digest``),
        by name: a router hashes an adapter request's prompt with
        ``common.block_hash.adapter_salt(self.block_hash_salt, lora_salts()[name])`` to find the
        blocks this engine holds for it. {} when ``enable_lora`` is off."""
        return self.loras.salts() if self.loras is not None else {}

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (vLLM's ``/v1/load_lora_adapter``):
        loaded and checked now, past ``max_loras`` the least recently used unheld one is evicted
        (it stays registered and is reloaded when a request names it). Call between steps.

        Raises:
            ValueError: LoRA is off, or the adapter is refused (the message says why: rank above
                ``--max-lora-rank``, a module the model lacks, another base model);
            FileNotFoundError: no PEFT adapter at ``path``.
        """
        if self.loras is None:
            raise ValueError("LoRA adapters are not enabled on this worker (start it with --enable-lora)")
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter ``name`` (False when unknown); requests running with it finish
        with it. Call between steps."""
        return self.loras is not None and self.loras.remove(name)

    def _acquire_lora(self, name: str) -> tuple[LoraEntry | None, AddResult | None]:
        """``(the adapter held for a new request, None)``, ``(None, None)`` for the base model, or
        ``(None, refusal)``: INVALID for an adapter not served here, NO_ROOM while every loaded
        adapter is held by other requests."""
        if not name:
            return None, None
        if self.loras is None:
            return None, AddResult(AddStatus.INVALID, f"LoRA adapter {name!r} requested, but LoRA is not enabled "
                                                      "on this worker (--enable-lora)")
        try:
            return self.loras.acquire(name), None
        except KeyError:
            # the adapters it does serve stay unnamed: a client's key may not be allowed to see them
            return None, AddResult(AddStatus.INVALID, f"unknown LoRA adapter {name!r} (unloaded, or not loaded yet)")
        except LoraNoRoom as exc:
            return None, AddResult(AddStatus.NO_ROOM, str(exc))
        except (ValueError, OSError) as exc:
            # the reason names server paths: logged here, not sent to a client that may not see them
            log.warning("LoRA adapter %r could not be reloaded for a request: %s", name, exc)
            return None, AddResult(AddStatus.INVALID, f"LoRA adapter {name!r} could not be loaded on this worker "
                                                      "(its files changed or are gone; an admin can load it again)")

    # ---- admission and stats ---------------------------------------------------
    def admission(self, num_context_tokens: int, max_new_tokens: int) -> AdmissionDecision:
        """Could a request of this size start now, must it wait, or can it never run?
        (:meth:`Scheduler.admission`, the one place that decides.)"""
        return self.scheduler.admission(num_context_tokens, max_new_tokens)

    def take_kv_events(self) -> KVEvents:
        """The prefix cache's stored/removed block hashes since the last call (empty unless
        ``config.enable_kv_events``); call between steps."""
        return self.block_manager.cache.take_events()

    def load(self) -> EngineLoad:
        """Running and waiting sequences and free KV blocks, without :meth:`stats`'s walk of
        every block table (call between steps)."""
        bm = self.block_manager
        return EngineLoad(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_free_blocks,
                          bm.num_blocks)

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (a snapshot; call between steps)."""
        return self.block_manager.cache.hashes()

    def next_batch_at(self) -> float | None:
        """Dynamic batching: clock time when the pending partial batch starts
        (the worker may sleep until then); None otherwise."""
        return self.scheduler.next_batch_at()

    def stats(self) -> EngineStats:
        """A snapshot for metrics and admission decisions."""
        bm, last, sch = self.block_manager, self._last, self.scheduler
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=bm.usage, num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            last_batch_size=len(last.scheduled) if last else 0,
            last_num_batched_tokens=last.num_batched_tokens if last else 0,
            num_steps=self._num_steps, prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens, batching=self.config.batching,
            num_used_blocks=bm.num_used_blocks, num_cached_blocks=bm.num_cached_blocks,
            fragmentation=bm.fragmentation(), prefix_cache_queries=sch.prefix_queries,
            prefix_cache_hits=sch.prefix_hits, policy=self.config.policy,
            spec_num_draft_tokens=self._num_draft_tokens, spec_num_accepted_tokens=self._num_accepted_tokens)
