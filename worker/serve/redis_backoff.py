"""Keeps a sick Redis from stalling the streams the worker is running.

The worker's loop talks to Redis between engine steps (XREADGROUP, XAUTOCLAIM,
XCLAIM keep-alives). A Redis that refuses connections fails those calls in
microseconds, but one that hangs (a partition that drops packets, a stopped or
swamped server) would hold the loop, and with it every running stream, for the
client's whole socket timeout on each step. So while requests run, each such
call is bounded by ``LOOP_REDIS_TIMEOUT_S`` and, after a failure, the loop
leaves Redis alone for a backoff that doubles up to ``MAX_BACKOFF_S`` and
resets on the next success (the usual exponential backoff of a circuit
breaker). Running requests then lose at most one bounded wait per backoff
period; nothing is read from Redis meanwhile, so nothing new is started. An
idle worker backs off the same way, so a Redis that stays down costs one
warning per backoff period, not one per poll.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: Seconds one loop Redis call may take while requests run (plus any block time).
#: A healthy Redis on the same network answers in well under a millisecond.
LOOP_REDIS_TIMEOUT_S = 0.25
#: First and longest pause (seconds) of the loop's Redis polling after a failure.
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


@dataclass
class RedisBackoff:
    """When the worker loop may poll Redis again after a failed call.

    Attributes:
        first_s: pause after the first failure, seconds.
        max_s: longest pause, seconds.
    """

    first_s: float = FIRST_BACKOFF_S
    max_s: float = MAX_BACKOFF_S
    _pause_s: float = field(default=0.0, init=False)
    _until: float = field(default=0.0, init=False)  # monotonic s

    def allows(self) -> bool:
        """True unless a failure less than the current pause ago says to wait."""
        return time.monotonic() >= self._until

    def failed(self) -> float:
        """Record a failed call; returns the pause (seconds) before the next poll."""
        self._pause_s = min(self.max_s, self._pause_s * 2) if self._pause_s else self.first_s
        self._until = time.monotonic() + self._pause_s
        return self._pause_s

    def succeeded(self) -> None:
        """Record a call that worked: the next failure starts over at ``first_s``."""
        self._pause_s = 0.0
        self._until = 0.0
