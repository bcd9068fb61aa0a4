"""How much memory this process may still take on the host: the kernel's estimate of
what new allocations can get without swapping (``MemAvailable`` in ``/proc/meminfo``),
lowered to what is left under the process's cgroup v2 memory limit (``memory.max`` less
``memory.current``: a container's ``--memory``, a Kubernetes memory limit).

Source of the fields: the Linux kernel's Documentation/filesystems/proc.rst (MemAvailable)
and Documentation/admin-guide/cgroup-v2.rst (memory.max, memory.current).
"""

from __future__ import annotations

from pathlib import Path

PROC_MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def available_bytes(meminfo: Path = PROC_MEMINFO, cgroup_root: Path = CGROUP_ROOT,
                    self_cgroup: Path = PROC_SELF_CGROUP) -> int | None:
    """Bytes this process can still allocate: ``MemAvailable``, or the room left under its
    cgroup v2 ``memory.max`` when that is smaller. None when neither can be read (not Linux).
    Never raises: an unreadable or malformed file counts as absent."""
    found = [b for b in (_mem_available(meminfo), _cgroup_room(cgroup_root, self_cgroup)) if b is not None]
    return min(found) if found else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(cgroup_root: Path, self_cgroup: Path) -> int | None:
    try:
        # cgroup v2: one line "0::/path/of/the/group"
        rel = next(line[3:] for line in self_cgroup.read_text().splitlines() if line.startswith("0::"))
        folder = cgroup_root / rel.strip().lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((folder / "memory.current").read_text().strip()))
    except (OSError, ValueError, StopIteration):
        return None
