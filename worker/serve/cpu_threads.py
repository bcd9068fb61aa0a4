"""How many CPU threads the worker's torch and kernel work uses.

A process sees every core of the machine in ``os.cpu_count()``, but it may run on
fewer: its affinity mask (``taskset``, ``numactl -C``, a cpuset cgroup) and a CPU
quota (a container's ``--cpus``, a Kubernetes CPU limit: cgroup v2 ``cpu.max``,
v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``). OpenMP's default of one thread
per visible core then runs more threads than the process has CPUs: at every
barrier of a parallel op the team waits for a thread that is not running, and
under a quota the whole team is throttled for the rest of the period. So the
worker takes the smaller of the two, rounded down, at least 1, the rule Uber's
``automaxprocs`` applies to Go's GOMAXPROCS. ``--threads`` overrides it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from common.cgroups import CGROUP_ROOT, PROC_SELF_CGROUP, group_limits


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count chosen, and why, for the log.

    Attributes:
        threads: threads for torch's intra-op pool and our OpenMP kernels (>= 1).
        why: one line naming what limited it.
    """

    threads: int
    why: str


def cpu_quota_cores(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in cores (the
    smallest one found), or None when there is none or it cannot be read.

    cgroup v2: ``cpu.max`` holds ``"<quota_us> <period_us>"`` or ``"max <period_us>"``;
    v1: ``cpu/cpu.cfs_quota_us`` (-1 = none) and ``cpu/cpu.cfs_period_us``
    (Linux kernel docs, Documentation/admin-guide/cgroup-v2.rst and
    scheduler/sched-bwc.rst)."""
    quotas = group_limits("cpu", _v2_quota, _v1_quota, cgroup_root, proc_cgroup)
    return min(quotas) if quotas else None


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def choose_threads(requested: int | None = None, affinity: int | None = None,
                   quota_cores: float | None | str = "read") -> ThreadChoice:
    """The worker's thread count.

    Args:
        requested: ``--threads`` (None = choose).
        affinity: CPUs in the affinity mask (None = ``len(os.sched_getaffinity(0))``).
        quota_cores: the cgroup CPU quota in cores, None for none ("read" = read it
            with :func:`cpu_quota_cores`).

    Raises:
        ValueError: ``requested`` below 1.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return ThreadChoice(requested, f"--threads {requested}")
    cpus = len(os.sched_getaffinity(0)) if affinity is None else affinity
    quota = cpu_quota_cores() if quota_cores == "read" else quota_cores
    why = f"{cpus} CPU(s) in the affinity mask"
    if quota is None or math.floor(quota) >= cpus:
        return ThreadChoice(cpus, why + ("" if quota is None else f", within the cgroup quota of {quota:g} CPUs"))
    threads = max(1, math.floor(quota))
    return ThreadChoice(threads, f"the cgroup CPU quota of {quota:g} CPUs ({why})")
