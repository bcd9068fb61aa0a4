"""Resident memory and load time of the engines a bench run compares (issue 48: a worker's
resident memory after load and warm-up should stay near its GGUF file's size).

Resident memory is ``VmRSS`` from ``/proc/<pid>/status``: private pages plus the pages of
memory-mapped files that were read (a GGUF kept in its own blocks counts its file pages
once read), in MiB."""

from __future__ import annotations

from pathlib import Path


def resident_mib(pid: int | str = "self") -> float | None:
    """``VmRSS`` of process ``pid`` in MiB; None where ``/proc`` does not say (not Linux, or
    the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def describe(name: str, load_s: float, rss_mib: float | None, model: str | Path | None) -> str:
    """One line: ``name``'s load time (s), resident memory (MiB, ``rss_mib``) and the model
    file's size."""
    size = ""
    if model is not None and Path(model).is_file():
        size = f", file {Path(model).stat().st_size / 2**20:.0f} MiB"
    rss = "unknown" if rss_mib is None else f"{rss_mib:.0f} MiB"
    return f"{name}: load {load_s:.1f} s, resident {rss}{size}"
