"""Progress of long work (model load, CPU kernel build, warm-up): a bar on a terminal, one
log line every few seconds otherwise.

On a terminal (stderr is a TTY) :class:`Progress` draws a ``rich`` progress bar; in a log
file or a container it logs one INFO line on the ``inflight.progress`` logger every
``interval_s`` seconds (``"loading weights: 41% (110.2/268.1 MB), 4 s"``) and one when the
work ends, as llama.cpp's loader prints dots and vLLM logs its load time. ``inflight up``
relays those lines from the worker's log while it waits (stack/startup.py), so they are the
one format a person reads both ways. Work without a measure (a warm-up pass) gives
``total=None``: the bar spins and the lines carry the elapsed time only.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

#: The logger of every progress line; ``inflight up`` recognises a line by this name.
LOGGER_NAME = "inflight.progress"
log = logging.getLogger(LOGGER_NAME)

_UNITS = {"B": (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))}


def _amount(value: float, unit: str) -> str:
    """``value`` in ``unit``, scaled for bytes (``"268.1 MB"``); other units as counts."""
    for name, scale in _UNITS.get(unit, ()):
        if value >= scale:
            return f"{value / scale:.1f} {name}"
    return f"{value:g}{' ' + unit if unit else ''}"


class Progress:
    """A context manager reporting the progress of one piece of work.

    Args:
        description: what is being done, as a person says it ("loading weights").
        total: the amount of work (bytes when ``unit`` is "B", else a count); None when unknown.
        unit: "B" for bytes (shown as kB/MB/GB), or a noun for counts ("sources").
        interval_s: seconds between two log lines when not on a terminal.
        stream: where the terminal bar is drawn (default stderr); the bar is drawn only when
            it is a TTY.

    ``advance(n)`` and ``update(done)`` may be called from any thread.
    """

    def __init__(self, description: str, total: float | None = None, unit: str = "",
                 interval_s: float = 5.0, stream: TextIO | None = None):
        self.description = description
        self.total = total
        self.unit = unit
        self.interval_s = interval_s
        self.done = 0.0
        self._stream = stream if stream is not None else sys.stderr
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None  # rich.progress.Progress on a terminal
        self._task = None

    # ------------------------------------------------------------ updates
    def advance(self, amount: float = 1) -> None:
        """Add ``amount`` to the work done."""
        self.update(self.done + amount)

    def update(self, done: float) -> None:
        """Set the work done so far to ``done``."""
        self.done = done
        if self._bar is not None:
            self._bar.update(self._task, completed=done)

    def line(self) -> str:
        """The current state as one line: ``"loading weights: 41% (110.2/268.1 MB), 4 s"``."""
        elapsed = time.monotonic() - self._started
        if self.total:
            pct = min(100.0, 100.0 * self.done / self.total)
            amount = (f"{_amount(self.done, self.unit)}/{_amount(self.total, self.unit)}" if self.unit == "B"
                      else f"{self.done:g}/{self.total:g}{' ' + self.unit if self.unit else ''}")
            return f"{self.description}: {pct:.0f}% ({amount}), {elapsed:.0f} s"
        return f"{self.description}: {elapsed:.0f} s"

    # ---------------------------------------------------------- lifecycle
    def __enter__(self) -> "Progress":
        self._started = time.monotonic()
        if self._stream.isatty():
            self._start_bar()
        else:
            log.info("%s …", self.description)
            self._thread = threading.Thread(target=self._tick, daemon=True, name="progress")
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.stop()
        if self._thread is not None:
            self._thread.join()
        elapsed = time.monotonic() - self._started
        if exc_type is None:
            size = f" ({_amount(self.done, self.unit)})" if self.total else ""
            log.info("%s: done in %.1f s%s", self.description, elapsed, size)
        else:
            log.info("%s: failed after %.1f s", self.description, elapsed)

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress as Bar,
                                   SpinnerColumn, TextColumn, TimeElapsedColumn)

        amount = DownloadColumn() if self.unit == "B" else MofNCompleteColumn()
        columns = ([TextColumn("{task.description}"), BarColumn(), amount, TimeElapsedColumn()]
                   if self.total else [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()])
        self._bar = Bar(*columns, console=Console(file=self._stream), transient=False)
        self._task = self._bar.add_task(self.description, total=self.total, completed=self.done)
        self._bar.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            log.info("%s", self.line())
