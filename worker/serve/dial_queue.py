"""The queue entry that waits while the worker dials its gateway.

The worker prefills a request only for a gateway it has a link to: a request
whose gateway is gone has no client left, and its prefill would be wasted on
every one of its ``max_deliveries`` deliveries (DESIGN.md, "gateway dies").
An entry whose ``reply_to`` has no live link waits here, off the engine, while
the dial runs in the background, so a slow or silent address never blocks the
step loop. The worker reads nothing more from Redis meanwhile (worker/serve/service.py,
``_admit``), so at most one entry waits. Once the channel is ready the entry goes
back to admission; when the dial fails the address is marked unreachable and
the entry is handed back to be deferred (``_defer``).
"""

from __future__ import annotations

import asyncio
import logging

from worker.serve.consumer import QueueEntry
from worker.serve.link_client import LinkPool

log = logging.getLogger(__name__)

#: Seconds a dial may take before the address counts as unreachable. A gateway on
#: the same network answers in milliseconds; an address that drops packets never does.
DIAL_TIMEOUT_S = 2.0


class DialQueue:
    """At most one entry waiting for its gateway's link, and the dial's outcome.

    Args:
        links: the worker's link pool (dials and remembers unreachable addresses).
        timeout_s: seconds one dial may take (default ``DIAL_TIMEOUT_S``).
    """

    def __init__(self, links: LinkPool, timeout_s: float | None = None):
        self._links = links
        self._timeout_s = DIAL_TIMEOUT_S if timeout_s is None else timeout_s
        self._entry: QueueEntry | None = None
        self._task: asyncio.Task[bool] | None = None

    def wait(self, entry: QueueEntry) -> None:
        """Hold ``entry`` and dial its gateway.

        Raises:
            RuntimeError: an entry is waiting already.
        """
        if self._entry is not None:
            raise RuntimeError("an entry is already waiting for its gateway's dial")
        self._entry = entry
        self._task = asyncio.create_task(self._dial(entry.request.reply_to))

    async def _dial(self, address: str) -> bool:
        try:
            link = await self._links.get(address)
            if await link.connected(self._timeout_s):
                return True
            await link.close()  # stop the channel's reconnection attempts
        except Exception as exc:  # noqa: BLE001 - a malformed address fails like a dead one
            log.warning("could not dial %s: %s", address, exc)
        self._links.mark_unreachable(address)
        return False

    def pending(self) -> bool:
        """True while an entry waits here (dialling, or dialled and not taken yet)."""
        return self._entry is not None

    def ready(self) -> QueueEntry | None:
        """The entry, once its gateway answered the dial; else None."""
        return self._take(True)

    def failed(self) -> QueueEntry | None:
        """The entry, once its dial failed (to be deferred); else None."""
        return self._take(False)

    def _take(self, outcome: bool) -> QueueEntry | None:
        if self._entry is None or not self._task.done() or self._task.result() != outcome:
            return None
        entry, self._entry, self._task = self._entry, None, None
        return entry

    def drain(self) -> QueueEntry | None:
        """Stop the dial and return the waiting entry, if any (the worker is stopping)."""
        if self._task is not None:
            self._task.cancel()
        entry, self._entry, self._task = self._entry, None, None
        return entry
