"""The worker's periodic stats line and its throughput over the last minute.

Every ``interval_s`` (10 s) the worker logs, at INFO, its prompt and generation throughput
since the last line, running and waiting sequences, KV-cache use and prefix-cache hit rate,
as vLLM's ``LoggingStatLogger`` (``log_stats``, turned off by ``--disable-log-stats``); an
idle worker's line goes to DEBUG once a line already said it was idle (vLLM does the same).
:class:`ThroughputWindow` keeps the token totals of the last minute for the
``inflight_avg_*_throughput_toks_per_s`` gauges that ``inflight status`` and the fleet page
show (vLLM v0 exported gauges of the same name).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("inflight.stats")


@dataclass
class ThroughputWindow:
    """Token totals sampled over the last ``window_s`` seconds.

    Args:
        window_s: the window, seconds (60: "tok/s over the last minute").
    """

    window_s: float = 60.0
    _samples: collections.deque = field(default_factory=collections.deque)

    def add(self, now: float, prompt_total: int, generation_total: int) -> None:
        """Record the engine's running totals (tokens since start) at monotonic time ``now``;
        samples older than the window, but the newest such one, are dropped."""
        self._samples.append((now, prompt_total, generation_total))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rates(self, now: float) -> tuple[float, float]:
        """(prompt, generation) tokens per second over the window ending at ``now``
        (over the time since the first sample while the worker is younger than the window)."""
        if not self._samples:
            return 0.0, 0.0
        t0, p0, g0 = self._samples[0]
        _, p1, g1 = self._samples[-1]
        span = max(min(now - t0, self.window_s), 1e-9) if now > t0 else 0.0
        if span == 0.0:
            return 0.0, 0.0
        return (p1 - p0) / span, (g1 - g0) / span


@dataclass
class StatsLogger:
    """Logs one stats line every ``interval_s`` seconds (call :meth:`observe` with each
    ``LLMEngine.stats()`` the loop takes, and :meth:`tick` every loop iteration).

    Args:
        interval_s: seconds between two lines (vLLM: 10).
        enabled: False (``--disable-log-stats``): no lines; the window is still kept.
    """

    interval_s: float = 10.0
    enabled: bool = True
    window: ThroughputWindow = field(default_factory=ThroughputWindow)
    _stats: object = None
    _last: tuple[float, int, int] | None = None  # (monotonic s, prompt total, generation total) at the last line
    _last_idle: bool = False
    _sampled_at: float = float("-inf")
    line: str = ""  #: the last stats line (also when not logged)

    def observe(self, stats, now: float | None = None) -> None:
        """Keep ``stats`` (an ``EngineStats``) for the next line, and sample the window at most
        once a second."""
        now = time.monotonic() if now is None else now
        self._stats = stats
        if self._last is None:
            self._last = (now, stats.prompt_tokens_total, stats.generation_tokens_total)
        if now - self._sampled_at >= 1.0:
            self.window.add(now, stats.prompt_tokens_total, stats.generation_tokens_total)
            self._sampled_at = now

    @property
    def observed(self) -> bool:
        """True once :meth:`observe` has been called."""
        return self._stats is not None

    def tick(self, now: float | None = None) -> bool:
        """When ``interval_s`` has passed since the last line: sample the window, log the line
        (kept in :attr:`line`; not with ``enabled`` False) and return True; else False."""
        now = time.monotonic() if now is None else now
        s = self._stats
        if s is None or self._last is None or now - self._last[0] < self.interval_s:
            return False
        self.window.add(now, s.prompt_tokens_total, s.generation_tokens_total)
        self._sampled_at = now
        t0, p0, g0 = self._last
        span = now - t0
        prompt_tps = (s.prompt_tokens_total - p0) / span
        gen_tps = (s.generation_tokens_total - g0) / span
        self._last = (now, s.prompt_tokens_total, s.generation_tokens_total)
        hit = (100.0 * s.prefix_cache_hits / s.prefix_cache_queries) if s.prefix_cache_queries else 0.0
        self.line = (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: "
                     f"{gen_tps:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                     f"KV cache usage: {100.0 * s.kv_usage:.1f}%, Prefix cache hit rate: {hit:.1f}%")
        idle = prompt_tps == 0 and gen_tps == 0 and s.num_running == 0 and s.num_waiting == 0
        if self.enabled:
            log.log(logging.DEBUG if idle and self._last_idle else logging.INFO, "%s", self.line)
        self._last_idle = idle
        return True
