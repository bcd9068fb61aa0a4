"""A closed-loop engine driver for the small benchmarks: ``batch`` requests at a time,
the next added as one finishes, greedy with EOS ignored, each token's arrival time kept."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ClosedRun:
    """What one closed-loop run measured.

    Attributes:
        seconds: wall time from the first step to the last output.
        output_tokens: tokens generated.
        token_times: per request, each token's arrival (seconds of the run's clock,
            ``time.perf_counter`` unless another was given); tokens that arrive in one output
            share a time.
        started: the run's first moment, on that clock.
        added: per request, when it was added to the engine, on that clock (TTFT = its first
            token's time minus this).
    """

    seconds: float
    output_tokens: int
    token_times: dict[str, list[float]]
    started: float = 0.0
    added: dict[str, float] | None = None

    @property
    def tok_s(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.seconds

    def tpot_p50_ms(self) -> float:
        """Median over requests of (last token - first token) / (tokens - 1), ms."""
        per = [1000 * (t[-1] - t[0]) / (len(t) - 1) for t in self.token_times.values() if len(t) > 1]
        return statistics.median(per)

    def itl_ms(self, quantile: float) -> float:
        """The ``quantile`` (0..1) of the gaps between a request's consecutive outputs, ms."""
        gaps = sorted(1000 * (b - a) for t in self.token_times.values() for a, b in zip(t, t[1:]) if b > a)
        return gaps[min(len(gaps) - 1, int(quantile * len(gaps)))] if gaps else 0.0


def run_closed(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, batch: int,
               before_step: Callable[[], object] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> ClosedRun:
    """Run ``prompts`` (token ids) through ``engine``, ``batch`` at a time, each for
    ``max_tokens`` greedy tokens; ``before_step`` is called before every step; times are
    read from ``clock`` (seconds).

    Raises:
        RuntimeError: the engine refused a request."""
    pending = list(enumerate(prompts))
    times: dict[str, list[float]] = {}
    added: dict[str, float] = {}
    generated = 0
    started = clock()
    while pending or engine.has_unfinished():
        while pending and engine.stats().num_running + engine.stats().num_waiting < batch:
            i, prompt = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            result = engine.add_request(EngineRequest(f"r{i}", prompt, params))
            if not result.ok:
                raise RuntimeError(f"request r{i} refused: {result.reason}")
            added[f"r{i}"] = clock()
        if before_step is not None:
            before_step()
        for out in engine.step():
            now = clock()
            times.setdefault(out.request_id, []).extend([now] * len(out.token_ids))
            generated += len(out.token_ids)
    return ClosedRun(clock() - started, generated, times, started, added)
