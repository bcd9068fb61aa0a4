"""worker.serve.cpu_threads: the thread count follows the affinity mask and the cgroup
CPU quota; a real worker process started under a one-CPU mask chooses one thread."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.serve.cpu_threads import choose_threads, cpu_quota_cores


def _tree(tmp_path: Path, proc_lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_lines)
    return root, proc


def test_v2_quota_is_the_smallest_along_the_path(tmp_path):
    root, proc = _tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cpu.max": "max 100000\n",
        "kubepods/cpu.max": "400000 100000\n",
        "kubepods/pod1/ctr/cpu.max": "150000 100000\n",
    })
    assert cpu_quota_cores(root, proc) == 1.5


def test_v2_without_a_limit(tmp_path):
    root, proc = _tree(tmp_path, "0::/a\n", {"a/cpu.max": "max 100000\n"})
    assert cpu_quota_cores(root, proc) is None


def test_v1_cfs_quota(tmp_path):
    root, proc = _tree(tmp_path, "12:memory:/x\n4:cpu,cpuacct:/docker/abc\n", {
        "cpu/docker/abc/cpu.cfs_quota_us": "200000\n", "cpu/docker/abc/cpu.cfs_period_us": "100000\n",
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
    })
    assert cpu_quota_cores(root, proc) == 2.0


def test_unreadable_cgroup_is_no_quota(tmp_path):
    assert cpu_quota_cores(tmp_path, tmp_path / "missing") is None


@pytest.mark.parametrize("affinity, quota, threads, names", [
    (2, None, 2, "affinity"),
    (4, 1.5, 1, "quota"),
    (4, 0.5, 1, "quota"),
    (1, 8.0, 1, "affinity"),
    (8, 3.0, 3, "quota"),
])
def test_choose_takes_the_smaller_rounded_down(affinity, quota, threads, names):
    choice = choose_threads(affinity=affinity, quota_cores=quota)
    assert choice.threads == threads and names in choice.why


def test_requested_threads_win_and_are_checked():
    assert choose_threads(3, affinity=1, quota_cores=0.5).threads == 3
    with pytest.raises(ValueError, match="--threads"):
        choose_threads(0)


def _worker_log_line(tmp_path: Path, cpus: set[int], *extra: str) -> str:
    """Start ``inflight worker`` with affinity ``cpus`` and return its thread-count log line."""
    log_path = tmp_path / "worker.log"
    cmd = [sys.executable, "-m", "inflight.cli", "worker", "--redis-url", "redis://127.0.0.1:1/0",
           "--health-port", "0", "--grpc-health-port", "0", "--device", "cpu", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lines = [line for line in log_path.read_text().splitlines() if "CPU thread(s)" in line]
            if lines:
                return lines[0]
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        raise AssertionError("no thread-count line in the worker's log:\n" + log_path.read_text())
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_under_a_one_cpu_mask_runs_one_thread(tmp_path):
    line = _worker_log_line(tmp_path, {0})
    assert "1 CPU thread(s): 1 CPU(s) in the affinity mask" in line


def test_a_worker_with_threads_flag(tmp_path):
    assert "2 CPU thread(s): --threads 2" in _worker_log_line(tmp_path, {0}, "--threads", "2")
