"""Queue entries that wait while the worker dials their gateway.

The worker prefills a request only for a gateway it has a link to: a request
whose gateway is gone has no client left, and its prefill would be wasted on
every one of its ``max_deliveries`` deliveries (DESIGN.md, "gateway dies").
An entry whose ``reply_to`` has no live link waits here, off the engine, while
one dial per address runs in the background; the step loop is never blocked by
a slow or silent address. Once the channel is ready the entry goes back to
admission; when the dial fails the address is marked unreachable and the entry
is handed to the caller to defer (worker/service.py, ``_defer``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from worker.consumer import QueueEntry
from worker.link_client import LinkPool

log = logging.getLogger(__name__)

#: Seconds a dial may take before the address counts as unreachable. A gateway on
#: the same network answers in milliseconds; an address that drops packets never does.
DIAL_TIMEOUT_S = 2.0


class DialQueue:
    """Entries waiting for their gateway's link, by address.

    Args:
        links: the worker's link pool (dials and remembers unreachable addresses).
        timeout_s: seconds one dial may take (default ``DIAL_TIMEOUT_S``).
    """

    def __init__(self, links: LinkPool, timeout_s: float | None = None):
        self._links = links
        self._timeout_s = DIAL_TIMEOUT_S if timeout_s is None else timeout_s
        self._waiting: dict[str, list[QueueEntry]] = {}  # address -> entries, while its dial runs
        self._ready: deque[QueueEntry] = deque()          # their link is up: admit them again
        self._failed: list[QueueEntry] = []               # their dial failed: defer them
        self._tasks: set[asyncio.Task] = set()

    def wait(self, entry: QueueEntry) -> None:
        """Hold ``entry`` until its gateway's link is up, dialling it if no dial runs."""
        address = entry.request.reply_to
        if address in self._waiting:
            self._waiting[address].append(entry)
            return
        self._waiting[address] = [entry]
        task = asyncio.create_task(self._dial(address))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dial(self, address: str) -> None:
        link = None
        try:
            link = await self._links.get(address)
            up = await link.connected(self._timeout_s)
        except Exception as exc:  # noqa: BLE001 - a malformed address fails like a dead one
            log.warning("could not dial %s: %s", address, exc)
            up = False
        entries = self._waiting.pop(address, [])
        if up:
            self._ready.extend(entries)
            return
        self._links.mark_unreachable(address)
        self._failed.extend(entries)
        if link is not None:
            await link.close()  # stop the channel's reconnection attempts

    def ready(self) -> QueueEntry | None:
        """The next entry whose link came up, or None."""
        return self._ready.popleft() if self._ready else None

    def failed(self) -> list[QueueEntry]:
        """The entries whose dial failed since the last call (to be deferred)."""
        failed, self._failed = self._failed, []
        return failed

    def dialling(self) -> bool:
        """True while a dial runs."""
        return bool(self._waiting)

    def pending(self) -> bool:
        """True while a dial runs or an entry waits to be admitted or deferred."""
        return bool(self._waiting or self._ready or self._failed)

    def drain(self) -> list[QueueEntry]:
        """Stop every dial and return every entry held here (the worker is stopping)."""
        for task in self._tasks:
            task.cancel()
        entries = [e for waiting in self._waiting.values() for e in waiting]
        entries += [*self._ready, *self._failed]
        self._waiting.clear()
        self._ready.clear()
        self._failed.clear()
        return entries
