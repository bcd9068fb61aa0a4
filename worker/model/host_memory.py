"""How much memory this process may still take on the host: the kernel's estimate of
what new allocations can get without swapping (``MemAvailable`` in ``/proc/meminfo``),
lowered to the room left under every memory limit of the process's control groups, its
own and its ancestors' (a container's ``--memory``, a Kubernetes pod's memory limit):
cgroup v2 ``memory.max`` less ``memory.current``, cgroup v1 ``memory.limit_in_bytes`` less
``memory.usage_in_bytes``. Inside a container the group's path from ``/proc/self/cgroup``
may not exist under ``/sys/fs/cgroup``, whose own files are then the group's: the walk up
the ancestors ends there. Usage counts the page cache too (the model file just read), so
the room errs on the small side.

Source of the fields: the Linux kernel's Documentation/filesystems/proc.rst (MemAvailable),
Documentation/admin-guide/cgroup-v2.rst (memory.max, memory.current) and
Documentation/admin-guide/cgroup-v1/memory.rst (memory.limit_in_bytes, memory.usage_in_bytes).
"""

from __future__ import annotations

from pathlib import Path

from common.cgroups import CGROUP_ROOT, PROC_SELF_CGROUP, group_limits

PROC_MEMINFO = Path("/proc/meminfo")
NO_LIMIT = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def available_bytes(meminfo: Path = PROC_MEMINFO, cgroup_root: Path = CGROUP_ROOT,
                    self_cgroup: Path = PROC_SELF_CGROUP) -> int | None:
    """Bytes this process can still allocate: ``MemAvailable``, or the smallest room left
    under a memory limit of its control groups when that is smaller. None when nothing can
    be read (not Linux). Never raises: an unreadable or malformed file counts as absent."""
    found = [b for b in (_mem_available(meminfo), *_cgroup_rooms(cgroup_root, self_cgroup)) if b is not None]
    return min(found) if found else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_rooms(cgroup_root: Path, self_cgroup: Path) -> list[int]:
    """The room under each memory limit of the process's groups, v2 and v1."""
    return group_limits("memory", _v2_room, _v1_room, cgroup_root, self_cgroup)


def _v2_room(folder: Path) -> int | None:
    return _room(folder, "memory.max", "memory.current")


def _v1_room(folder: Path) -> int | None:
    return _room(folder, "memory.limit_in_bytes", "memory.usage_in_bytes")


def _room(folder: Path, limit_file: str, usage_file: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= NO_LIMIT:
            return None
        return max(0, int(limit) - int((folder / usage_file).read_text().strip()))
    except (OSError, ValueError):
        return None
