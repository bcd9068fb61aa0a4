"""Where the machine's CPU went during a run: CPU seconds per process role.

The stack target runs the client, nginx, the gateway, Redis and the worker on
one machine. Whether the stack loses throughput to the engine because the
worker gets less CPU, or because it spends more CPU per token, is read from
these figures: ``/proc/<pid>/stat`` user + system time (fields 14 and 15,
``proc(5)``) of the bench process and every process descended from it,
snapshotted before and after the run. Linux only; elsewhere the snapshot is
empty and nothing is reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

#: cmdline fragments → role, first match wins (the bench process itself is "client").
_ROLES = (("redis-server", "redis"), ("nginx", "nginx"), (" worker", "worker"), (" gateway", "gateway"))


@dataclass(frozen=True)
class ProcCpu:
    """One process at one instant: its role and cumulative CPU time, seconds."""

    role: str
    cpu_s: float


@dataclass(frozen=True)
class CpuShare:
    """CPU seconds per role over one run of ``wall_s`` seconds on ``cores`` CPUs,
    and the machine's idle CPU seconds (``/proc/stat`` idle + iowait; None
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


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of ``pid``, or None if it is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the comm field may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "client"
    try:
        cmd = " " + (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    return next((role for frag, role in _ROLES if frag in cmd), "other")


#: snapshot key of the machine-wide idle time (no pid is negative).
IDLE_KEY = -1


def _idle_s() -> float | None:
    """Idle + iowait seconds of all CPUs since boot (first line of ``/proc/stat``)."""
    try:
        fields = (_PROC / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    return (int(fields[4]) + int(fields[5])) * _TICK_S


def snapshot(root: int | None = None) -> dict[int, ProcCpu]:
    """Cumulative CPU time of ``root`` (default: this process) and all its descendants, by pid,
    plus the machine's idle time under :data:`IDLE_KEY` (role "idle")."""
    root = os.getpid() if root is None else root
    if not _PROC.is_dir():
        return {}
    stats = {int(p.name): s for p in _PROC.iterdir() if p.name.isdigit() and (s := _stat(int(p.name)))}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    if (idle := _idle_s()) is not None:
        out[IDLE_KEY] = ProcCpu("idle", idle)
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = ProcCpu(_role(pid, root), stats[pid][1])
        todo.extend(children.get(pid, []))
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
