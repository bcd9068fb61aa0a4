"""Keeping the owner leases of this gateway's open streams alive (gateway/stream_journal.py).

Each streamed request's journal holds a lease in Redis (``lease_s`` seconds) that its appends
refresh; a stream whose model is slow to produce a chunk (a queue wait, a long prefill) would
let it lapse, and a resume elsewhere would then take over a stream that is still running here.
One :class:`LeaseKeeper` per gateway refreshes every held lease each third of ``lease_s``; a
lease found lost (another gateway took the stream over) is dropped and its stream told, so
it cancels its run at once rather than at its next chunk.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from gateway.stream_journal import StreamJournal

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Refreshes the leases of the journals :meth:`hold` was given until :meth:`drop`.

    Args:
        lease_s: the leases' lifetime in seconds; they are refreshed every ``lease_s / 3``.

    Its task runs only while it holds a lease (started by :meth:`hold`, ending when none is
    left), so a gateway without open streams runs nothing. :meth:`close` (the gateway's
    shutdown) cancels and awaits it; the leases still held then lapse by themselves.
    """

    def __init__(self, lease_s: float):
        self.interval_s = lease_s / 3
        self._held: dict[StreamJournal, Callable[[], Awaitable[None]]] = {}
        self._task: asyncio.Future | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, journal: StreamJournal, on_lost: Callable[[], Awaitable[None]]) -> None:
        """Keep ``journal``'s lease alive; ``on_lost()`` is awaited once if it is lost."""
        self._held[journal] = on_lost
        if not self._closed and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self._run())

    def drop(self, journal: StreamJournal) -> None:
        """Stop refreshing ``journal``'s lease (its stream ended; it releases the lease itself)."""
        self._held.pop(journal, None)

    async def close(self) -> None:
        """Stop refreshing (the gateway shuts down): cancel the task and wait for it to end,
        so none is left pending on the loop. The leases held lapse after ``lease_s``; a
        stream that still holds one afterwards is not refreshed any more."""
        self._closed = True
        self._held.clear()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # its CancelledError stays in it; ours, if any, propagates

    async def _run(self) -> None:
        while self._held:
            await asyncio.sleep(self.interval_s)
            for journal, on_lost in list(self._held.items()):
                if journal not in self._held:
                    continue
                if await journal.refresh():
                    continue
                self._held.pop(journal, None)
                log.warning("stream journal %s: the lease was taken over by another gateway; "
                            "cancelling this gateway's run", journal.key)
                try:
                    await on_lost()
                except Exception:  # one stream's failure must not stop the others' refreshes
                    log.exception("stream journal %s: handling the lost lease failed", journal.key)
