"""Grammar-constrained decoding (structured outputs) in the engine, with llguidance.

A constrained request's grammar (:class:`~worker.engine.sampling_params.GrammarSpec`) is
compiled on a worker thread, never on the engine thread, and cached by the spec's key:
the cache holds one compiled matcher per grammar in its start state, and each sequence
(each of ``n`` choices) gets its own copy (``LLMatcher.deep_copy``). Until the compile
is done the request waits outside the scheduler (vLLM's ``WAITING_FOR_FSM``) while the
other requests keep stepping. Each step, :meth:`GrammarRuntime.bitmask` fills one token
bitmask row per constrained logits row (llguidance's parallel executor), the sampler sets
the tokens outside it to -inf, and :meth:`GrammarRuntime.advance` feeds the sampled
token to the sequence's matcher. The matcher lives as long as its sequence, so a
preemption (recompute) keeps its state; a continuation replays its resumed tokens.
Algorithm: llguidance (Moskal et al., https://github.com/guidance-ai/llguidance), a
derivative-based lexer under an Earley parser, masks computed over the token trie.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from worker.engine.sampler import TokenBitmask
from worker.engine.sampling_params import GrammarSpec

log = logging.getLogger(__name__)

#: Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar that llguidance refused (the message says why)."""


class GrammarCompiler:
    """Compiles grammars off the calling thread and caches them by key.

    Args:
        tokenizer: the engine's tokenizer; llguidance's tokenizer is built from its
            ``hf`` (a ``tokenizers.Tokenizer``) and ``eos_token_ids`` on first use
            (a noticeable one-time cost on a 49,152-token vocabulary: bench/RESULTS.md, "Measurements first recorded in docstrings").
        vocab_size: the logits' width (the model's vocabulary, >= the tokenizer's).
        max_workers: compile threads (llguidance releases the GIL while it compiles).
        cache_size: compiled grammars kept.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_workers: int = 1,
                 cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self.hits = self.misses = 0

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer (built once).

        Raises:
            GrammarError: the tokenizer has no ``hf`` (a test fake).
        """
        with self._lock:
            if self._ll is None:
                hf = getattr(self._tokenizer, "hf", None)
                if hf is None:
                    raise GrammarError("this tokenizer cannot drive a grammar (no tokenizers.Tokenizer)")
                self._ll = llguidance.LLTokenizer(hf.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._ll

    def prepare(self) -> concurrent.futures.Future:
        """Build llguidance's tokenizer now, on a compile thread, so the first constrained
        request does not wait for it (0.4-1.7 s); the worker calls this as it builds its
        engine, so the build overlaps the warm-up.
        The future's result is the tokenizer, or raises :class:`GrammarError` as
        :meth:`ll_tokenizer` does."""
        return self._pool.submit(self.ll_tokenizer)

    def compile(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """A future of ``spec``'s compiled matcher in its start state (copy it before use);
        a cached one when the key was compiled before. Its result raises
        :class:`GrammarError` for a grammar llguidance refuses."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._build, spec.grammar)
            self._cache[spec.key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error()[:500])
        return matcher

    def shutdown(self) -> None:
        """Stop the compile threads (pending compiles are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Pending:
    """A request whose grammar compiles: its sequences and the tokens each replays."""

    future: concurrent.futures.Future
    seqs: list[Any]
    resumed: list[int]


class GrammarRuntime:
    """The grammar state of an engine's constrained sequences (one engine thread).

    Args:
        compiler: a :class:`GrammarCompiler`.
        mask_threads: threads of llguidance's mask executor (default: the CPUs, at most 4).
    """

    def __init__(self, compiler: GrammarCompiler, mask_threads: int | None = None) -> None:
        self.compiler = compiler
        self._executor: llguidance.LLExecutor | None = None
        self._mask_threads = mask_threads or max(1, min(4, os.cpu_count() or 1))
        self._pending: dict[str, _Pending] = {}
        self._matchers: dict[int, llguidance.LLMatcher] = {}

    @property
    def words(self) -> int:
        """int32 words of one bitmask row: ceil(vocab / 32)."""
        return (self.compiler.vocab_size + 31) // 32

    def wait(self, request_id: str, spec: GrammarSpec, seqs: list[Any], resumed: list[int]) -> None:
        """Start compiling ``spec`` for the sequences of ``request_id``; they join the
        scheduler once :meth:`ready` returns them. ``resumed``: a continuation's tokens,
        replayed into each matcher."""
        self._pending[request_id] = _Pending(self.compiler.compile(spec), seqs, list(resumed))

    def drop(self, request_id: str) -> bool:
        """Forget a request still waiting for its grammar (abort); True if it was."""
        return self._pending.pop(request_id, None) is not None

    @property
    def num_waiting(self) -> int:
        """Requests whose grammar is still compiling (or whose compile has not been collected)."""
        return len(self._pending)

    def wait_any(self, timeout_s: float) -> None:
        """Block at most ``timeout_s`` seconds until a pending compile finishes (the engine
        calls it when it has nothing else to run)."""
        futures = [p.future for p in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def ready(self) -> list[tuple[str, list[Any], str]]:
        """Requests whose compile finished since the last call: ``(request_id, seqs, error)``,
        ``error`` "" when each sequence now has its matcher, else why the grammar failed."""
        done = []
        for request_id, pending in list(self._pending.items()):
            if not pending.future.done():
                continue
            del self._pending[request_id]
            done.append((request_id, pending.seqs, self._start(pending)))
        return done

    def _start(self, pending: _Pending) -> str:
        try:
            template = pending.future.result()
        except GrammarError as exc:
            return f"the grammar failed to compile: {exc}"
        except Exception as exc:  # noqa: BLE001 - a compile thread's failure must not kill the engine
            log.exception("grammar compile failed")
            return f"the grammar failed to compile: {exc}"
        for seq in pending.seqs:
            matcher = template.deep_copy()
            if pending.resumed and not matcher.consume_tokens(pending.resumed):
                return f"the resumed tokens do not match the grammar: {matcher.get_error()[:300]}"
            self._matchers[seq.seq_id] = matcher
        return ""

    def constrained(self, seq_id: int) -> bool:
        """True when ``seq_id`` has a matcher."""
        return seq_id in self._matchers

    def bitmask(self, row_seq_ids: list[int]) -> TokenBitmask | None:
        """The allowed tokens of each constrained row of a logits batch.

        Args:
            row_seq_ids: the sequence id of each logits row (a verification chunk's id
                repeats; constrained sequences never verify drafts).

        Returns:
            None when no row is constrained; else a :class:`TokenBitmask` over the
            constrained rows, ``bits`` [R, ceil(V/32)] int32 filled by llguidance.
        """
        rows = [r for r, sid in enumerate(row_seq_ids) if sid in self._matchers]
        if not rows:
            return None
        bits = np.zeros((len(rows), self.words), dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self._mask_threads)
        llg_numpy.fill_next_token_bitmask_par(
            self._executor, [(self._matchers[row_seq_ids[r]], i) for i, r in enumerate(rows)], bits)
        return TokenBitmask(rows, bits)

    def advance(self, seq_id: int, token: int) -> tuple[str, str]:
        """Feed ``token``, just sampled for ``seq_id``, to its matcher.

        Returns:
            ``(state, error)``: state "free" (no matcher), "ok", "done" (the grammar is
            complete and admits no further token: finish the sequence) or "error" (the
            token broke the grammar; ``error`` is llguidance's reason).
        """
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return "free", ""
        if matcher.is_error():  # failed computing this step's mask (e.g. its lexer's budget): no token is right
            return "error", _first_line(matcher.get_error()) or "the grammar failed computing the allowed tokens"
        if not matcher.consume_token(token) or matcher.is_error():
            return "error", _first_line(matcher.get_error()) or f"token {token} is not allowed by the grammar"
        return ("done" if matcher.is_stopped() else "ok"), ""

    def release(self, seq_id: int) -> None:
        """Drop ``seq_id``'s matcher (its sequence finished)."""
        self._matchers.pop(seq_id, None)


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it appends (``\n<state>...``), at most
    300 characters: what a client is told."""
    return error.split("\n", 1)[0][:300]
