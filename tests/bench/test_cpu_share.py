"""bench.cpu_share: CPU seconds per process role, for this process and its children."""

from __future__ import annotations

import subprocess
import sys
import time

from bench import cpu_share

_BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\nsys.stdin.read()"


def test_a_childs_cpu_is_counted_under_its_role_and_our_own_as_client():
    before, t0 = cpu_share.snapshot(), time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", _BURN, "worker"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while (cpu := cpu_share.snapshot().get(child.pid)) is None or cpu.cpu_s < 0.4:
            assert time.monotonic() < deadline, "the child never burnt its 0.4 s"
            sum(range(20000))  # some CPU of our own too
            time.sleep(0.01)
        share = cpu_share.share(before, cpu_share.snapshot(), time.perf_counter() - t0)
    finally:
        child.communicate(b"")
    assert cpu.role == "worker"
    assert 0.4 <= share.by_role["worker"] < 5
    assert share.by_role["client"] > 0
    assert 0 < share.cores_used("worker") <= share.cores
    assert "worker" in share.describe() and "cores" in share.describe()
    assert share.idle_s is not None and 0 <= share.idle_s <= share.cores * share.wall_s + 0.1


def test_snapshot_is_empty_for_a_pid_that_does_not_exist():
    assert set(cpu_share.snapshot(root=2 ** 22 + 12345)) <= {cpu_share.IDLE_KEY}
