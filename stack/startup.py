"""What ``inflight up`` prints while the stack starts: the step it is in, the worker's
progress lines (kernel build, model load, warm-up; common/progress.py) relayed from its
log, and how long each step took.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, TextIO

from common.progress import LOGGER_NAME


def progress_message(line: str) -> str | None:
    """The message of a progress line of a service's log (text or JSON format,
    common/logs.py), or None for any other line."""
    line = line.strip()
    if line.startswith("{"):
        try:
            entry = json.loads(line)
        except ValueError:
            return None
        return entry.get("msg") if entry.get("logger") == LOGGER_NAME else None
    marker = f" {LOGGER_NAME}: "
    return line.split(marker, 1)[1] if marker in line else None


@dataclass
class LogFollower:
    """Reads the lines a log file gained since the last call (from its end at creation)."""

    path: Path
    _offset: int = 0

    def __post_init__(self) -> None:
        self._offset = self.path.stat().st_size if self.path.exists() else 0

    def new_progress(self) -> list[str]:
        """The progress messages (:func:`progress_message`) written since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a half-written last line waits for the next call
        self._offset += end
        lines = data[:end].decode(errors="replace").splitlines()
        return [m for m in map(progress_message, lines) if m]


@dataclass
class StartupSteps:
    """Prints each startup step as it begins and ends, with its duration.

    Args:
        stream: where to print (None: print nothing, for tests and library use).
    """

    stream: TextIO | None = None
    timings: list[tuple[str, float]] = field(default_factory=list)

    def say(self, text: str) -> None:
        """Print one indented detail line (a relayed progress line)."""
        if self.stream is not None:
            print(f"    {text}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the step ``name``; print its start and its end (or that it failed)."""
        if self.stream is not None:
            print(f"[{len(self.timings) + 1}] {name} …", file=self.stream, flush=True)
        started = time.monotonic()
        try:
            yield
        except BaseException:
            self.say(f"{name}: failed after {time.monotonic() - started:.1f} s")
            raise
        elapsed = time.monotonic() - started
        self.timings.append((name, elapsed))
        self.say(f"{name}: {elapsed:.1f} s")

    def summary(self) -> str:
        """``"ready in 41.3 s (redis 0.2 s, worker 38.9 s, ...)"``."""
        total = sum(t for _, t in self.timings)
        return f"ready in {total:.1f} s ({', '.join(f'{n} {t:.1f} s' for n, t in self.timings)})"


def default_steps() -> StartupSteps:
    """A reporter printing to stdout (``inflight up``)."""
    return StartupSteps(sys.stdout)
