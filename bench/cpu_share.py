"""Where the machine's CPU went during a run: CPU seconds per process role.

The stack target runs the client, nginx, the gateway, Redis and the worker on
one machine. Whether the stack loses throughput to the engine because the
worker gets less CPU, or because it spends more CPU per token, is read from
these figures: user + system time (psutil ``cpu_times``) of the bench process
and every process descended from it, and the machine's idle time, snapshotted
before and after the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

#: cmdline fragments → role, first match wins (the bench process itself is "client").
_ROLES = (("redis-server", "redis"), ("nginx", "nginx"), (" worker", "worker"), (" gateway", "gateway"))

#: snapshot key of the machine-wide idle time (no pid is negative).
IDLE_KEY = -1


@dataclass(frozen=True)
class ProcCpu:
    """One process at one instant: its role and cumulative CPU time, seconds."""

    role: str
    cpu_s: float


@dataclass(frozen=True)
class CpuShare:
    """CPU seconds per role over one run of ``wall_s`` seconds on ``cores`` CPUs,
    and the machine's idle CPU seconds (psutil: idle + iowait; None
    where unknown)."""

    by_role: dict[str, float]
    wall_s: float
    cores: int
    idle_s: float | None = None

    def cores_used(self, role: str) -> float:
        """Average CPUs busy with ``role`` over the run (CPU seconds / wall seconds)."""
        return self.by_role.get(role, 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    def describe(self) -> str:
        """One line: each role's CPU seconds and average cores, largest first, and the idle rest."""
        parts = [f"{role} {cpu:.1f} s ({self.cores_used(role):.2f} cores)"
                 for role, cpu in sorted(self.by_role.items(), key=lambda kv: -kv[1])]
        rest = max(self.cores * self.wall_s - sum(self.by_role.values()), 0.0)
        tail = f", not used by these {rest:.1f} s"
        if self.idle_s is not None:
            tail += f" (machine idle {self.idle_s:.1f} s, other processes {max(rest - self.idle_s, 0.0):.1f} s)"
        return f"CPU over {self.wall_s:.1f} s on {self.cores} cores: " + ", ".join(parts) + tail


def _role(proc: psutil.Process, root: int) -> str:
    if proc.pid == root:
        return "client"
    cmd = " " + " ".join(proc.cmdline())
    return next((role for frag, role in _ROLES if frag in cmd), "other")


def _idle_s() -> float:
    """Idle (+ iowait where the OS reports it) seconds of all CPUs since boot."""
    times = psutil.cpu_times()
    return times.idle + getattr(times, "iowait", 0.0)


def snapshot(root: int | None = None) -> dict[int, ProcCpu]:
    """Cumulative CPU time of ``root`` (default: this process) and all its descendants, by pid,
    plus the machine's idle time under :data:`IDLE_KEY` (role "idle"). A root that does not
    exist gives the idle entry alone; processes that exit meanwhile are left out."""
    out = {IDLE_KEY: ProcCpu("idle", _idle_s())}
    root = os.getpid() if root is None else root
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            times = proc.cpu_times()
            out[proc.pid] = ProcCpu(_role(proc, root), times.user + times.system)
        except psutil.Error:  # gone, or not ours to read
            continue
    return out


def share(before: dict[int, ProcCpu], after: dict[int, ProcCpu], wall_s: float) -> CpuShare:
    """CPU seconds each role spent between two snapshots; processes started in between count from 0."""
    idle = after[IDLE_KEY].cpu_s - before[IDLE_KEY].cpu_s if IDLE_KEY in after and IDLE_KEY in before else None
    by_role: dict[str, float] = {}
    for pid, now in after.items():
        if pid == IDLE_KEY:
            continue
        was = before.get(pid)
        by_role[now.role] = by_role.get(now.role, 0.0) + now.cpu_s - (was.cpu_s if was else 0.0)
    return CpuShare(by_role, wall_s, os.cpu_count() or 1, idle)
