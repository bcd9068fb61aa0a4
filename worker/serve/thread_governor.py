"""Fewer model threads while other processes keep our CPUs busy.

The worker runs one OpenMP team over the CPUs it may use (:mod:`worker.serve.cpu_threads`).
Every parallel op ends at a barrier, so when another process takes one of those CPUs
the whole team waits, at every op, for the thread the kernel has descheduled: on a
2-core machine one busy competitor cut a batch-4 engine run to a fraction of its
uncontended tokens/s (issue 23; bench/RESULTS.md run 22). One thread fewer than the CPUs
left free runs at the speed of the CPU it has instead.

:class:`ThreadGovernor` measures, once a second, how much CPU time processes other
than this one spent on the CPUs of its affinity mask (``/proc/stat`` busy time of
those CPUs minus this process's own CPU time), and sets the thread count to the
CPUs that leaves, ``len(cpus) - floor(other_cores + 0.4)``, within 1 and
``max_threads`` (a cgroup quota may set ``max_threads`` below the mask: then other
processes cost threads only once they leave fewer CPUs than the quota). A
competitor that holds 0.6 of a CPU or more costs one thread; when it stops, the
measured load falls and the threads come back within a second or two. The
gateway, nginx and Redis of a single-box stack use well below the threshold at
saturation (bench/RESULTS.md run 17).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
#: Busy columns of a ``cpuN`` line of /proc/stat (proc(5)): user nice system idle iowait
#: irq softirq steal ...; idle (3) and iowait (4) are not busy; steal is (another guest ran).
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
#: other_cores + this, rounded down, is the CPUs given up: 0.6 of a CPU costs one thread.
GIVE_UP_MARGIN = 0.4


def busy_cpu_seconds(cpus: Iterable[int], stat_path: Path = PROC_STAT) -> float:
    """Busy time of ``cpus`` since boot, seconds (all processes), from ``stat_path``.

    Raises:
        OSError: the file cannot be read.
    """
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    for line in stat_path.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in _BUSY_COLUMNS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads), seconds."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Adapts the model's thread count to the CPU other processes take.

    Call :meth:`tick` before each engine step, on the thread that runs the model
    (the OpenMP team belongs to it); it measures at most once per ``interval_s``.

    Args:
        max_threads: the thread count without competition (>= 1).
        set_threads: applies a thread count (e.g. ``torch.set_num_threads``).
        cpus: CPU ids of the affinity mask (default ``os.sched_getaffinity(0)``).
        interval_s: measurement window, seconds.
        busy: CPU ids -> busy seconds of those CPUs (default :func:`busy_cpu_seconds`).
        own: this process's CPU seconds (default :func:`own_cpu_seconds`).
        clock: monotonic seconds.

    Raises:
        ValueError: ``max_threads`` < 1 or ``interval_s`` <= 0.
    """

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], cpus: Iterable[int] | None = None,
                 interval_s: float = 1.0, busy: Callable[[Iterable[int]], float] = busy_cpu_seconds,
                 own: Callable[[], float] = own_cpu_seconds, clock: Callable[[], float] = time.monotonic) -> None:
        if max_threads < 1 or interval_s <= 0:
            raise ValueError(f"max_threads must be >= 1 and interval_s > 0, got {max_threads}, {interval_s}")
        self.max_threads = self.threads = max_threads
        self.cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
        self.interval_s = interval_s
        self.other_cores = 0.0  # the last window's CPU time of other processes, in CPUs
        self._set, self._busy, self._own, self._clock = set_threads, busy, own, clock
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            return self._clock(), self._busy(self.cpus), self._own()
        except OSError as exc:  # no /proc (not Linux): nothing to govern
            log.warning("thread governor off: %s", exc)
            return None

    def tick(self) -> int | None:
        """Measure if a window has passed and apply a new thread count; returns it
        when it changed, else None."""
        if self._last is None or self._clock() - self._last[0] < self.interval_s:
            return None
        now = self._sample()
        if now is None:
            self._last = None
            return None
        elapsed = now[0] - self._last[0]
        other = (now[1] - self._last[1]) - (now[2] - self._last[2])
        self._last = now
        self.other_cores = max(0.0, other / elapsed)
        free = len(self.cpus) - math.floor(self.other_cores + GIVE_UP_MARGIN)
        wanted = max(1, min(self.max_threads, free))
        if wanted == self.threads:
            return None
        log.info("other processes used %.2f of our %d CPUs over %.1f s: %d model thread(s), was %d",
                 self.other_cores, len(self.cpus), elapsed, wanted, self.threads)
        self.threads = wanted
        self._set(wanted)
        return wanted
