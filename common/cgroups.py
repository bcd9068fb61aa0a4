"""This process's control groups: the limits set on its group and every ancestor, in
cgroup v2 (the unified hierarchy) and v1 (one hierarchy per controller), as a container
runtime or Kubernetes sets them. Used for the CPU quota (worker/serve/cpu_threads.py) and
the memory limit (worker/model/host_memory.py).

Source: ``/proc/self/cgroup``'s format ("hierarchy-ID:controllers:path", v2's line
"0::path"), Linux kernel Documentation/admin-guide/cgroup-v2.rst and cgroup-v1/cgroups.rst.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")

T = TypeVar("T")


def group_limits(controller: str, read_v2: Callable[[Path], T | None], read_v1: Callable[[Path], T | None],
                 cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> list[T]:
    """Every limit that ``read_v2`` (a v2 group folder) or ``read_v1`` (a folder of the v1
    ``controller`` hierarchy) finds on this process's group and its ancestors up to the
    hierarchy's root (inside a container, whose path may not exist under ``cgroup_root``, the
    root's own files are the group's). A reader returns None for no limit or unreadable
    files. Never raises: unreadable or malformed ``proc_cgroup`` lines count as absent."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found: list[T] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            found += _up_to_root(cgroup_root, path, read_v2)
        elif controller in controllers.split(","):
            found += _up_to_root(cgroup_root / controller, path, read_v1)
    return found


def _up_to_root(base: Path, path: str, read: Callable[[Path], T | None]) -> list[T]:
    parts = [p for p in path.strip().strip("/").split("/") if p]
    found = []
    for depth in range(len(parts), -1, -1):
        value = read(base.joinpath(*parts[:depth]))
        if value is not None:
            found.append(value)
    return found
