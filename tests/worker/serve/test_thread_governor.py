"""The thread governor: threads follow the CPU other processes take from our mask."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from worker.serve.thread_governor import ThreadGovernor, busy_cpu_seconds, own_cpu_seconds


class _Machine:
    """A scripted clock and CPU counters: ``other`` CPUs of load from other processes
    and ``ours`` from this one, accumulated as the clock advances."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0
        self.other = self.ours = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.busy += (self.other + self.ours) * seconds
        self.own += self.ours * seconds


def _governor(machine: _Machine, cpus=(0, 1), max_threads: int = 2):
    applied: list[int] = []
    gov = ThreadGovernor(max_threads, applied.append, cpus=cpus, busy=lambda _: machine.busy,
                         own=lambda: machine.own, clock=lambda: machine.now)
    return gov, applied


def test_a_competitor_costs_a_thread_and_gives_it_back():
    m = _Machine()
    gov, applied = _governor(m)
    m.ours = 2.0
    m.advance(1.0)
    assert gov.tick() is None and gov.threads == 2  # alone
    m.ours, m.other = 1.33, 0.67  # a busy loop time-shares the two CPUs with our two threads
    m.advance(0.5)
    assert gov.tick() is None  # within the window: no measurement
    m.advance(0.5)
    assert gov.tick() == 1 and applied == [1]
    m.ours, m.other = 1.0, 1.0  # one thread each: it keeps a whole CPU
    m.advance(1.0)
    assert gov.tick() is None and gov.threads == 1
    m.ours, m.other = 1.0, 0.05  # it stopped
    m.advance(1.0)
    assert gov.tick() == 2 and applied == [1, 2]


def test_light_load_beside_us_keeps_every_thread():
    m = _Machine()
    gov, applied = _governor(m)
    m.ours, m.other = 1.8, 0.15  # the gateway, nginx and Redis of a single-box stack
    for _ in range(5):
        m.advance(1.0)
        gov.tick()
    assert gov.threads == 2 and not applied


def test_a_quota_below_the_mask_loses_threads_only_when_the_mask_runs_short():
    m = _Machine()
    gov, _ = _governor(m, cpus=range(16), max_threads=2)
    m.ours, m.other = 2.0, 10.0  # other pods on the node's 16 CPUs; 6 still free
    m.advance(1.0)
    assert gov.tick() is None and gov.threads == 2
    m.other = 14.0  # exactly 2 left: the quota's 2 threads still fit
    m.advance(1.0)
    assert gov.tick() is None and gov.threads == 2
    m.other, m.ours = 14.7, 1.3  # one of the 2 partly taken
    m.advance(1.0)
    assert gov.tick() == 1


def test_bad_arguments_and_no_proc():
    with pytest.raises(ValueError):
        ThreadGovernor(0, print)

    def unreadable(_):
        raise OSError("no /proc/stat")

    gov = ThreadGovernor(2, print, cpus=[0], busy=unreadable)
    assert gov.tick() is None and gov.threads == 2


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux /proc/stat and two CPUs")
def test_a_real_busy_process_on_our_cpu_is_measured():
    """A real busy loop pinned to one of two CPUs the governor watches: it reads at
    least 0.6 of a CPU of other load and gives a thread up."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpus[1]}}})\nwhile True: pass"])
    try:
        time.sleep(0.5)  # it runs
        applied: list[int] = []
        gov = ThreadGovernor(2, applied.append, cpus=cpus, interval_s=1.0)
        time.sleep(1.1)
        gov.tick()
        assert gov.other_cores >= 0.6 and applied == [1], gov.other_cores
    finally:
        busy.kill()
        busy.wait()


def test_the_readers_are_consistent():
    cpus = sorted(os.sched_getaffinity(0))
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    before_busy, before_own = busy_cpu_seconds(cpus), own_cpu_seconds()
    # Spin until this process has used 0.2 s of CPU (a loaded machine grants it later, not
    # less: the wall-clock guard is only against a counter that never moves); the CPUs'
    # busy time, which counts every process, includes ours.
    guard = time.monotonic() + 30
    while own_cpu_seconds() - before_own < 0.2:
        assert time.monotonic() < guard, "own CPU time did not advance"
    assert busy_cpu_seconds(cpus) - before_busy >= 0.2 - 0.02  # /proc/stat counts in 10 ms ticks
