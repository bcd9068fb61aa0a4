"""Queued requests whose Redis entry vanished are queued again.

A Redis restart without persistence (or a failover to a replica that had not
caught up, or a FLUSHALL) loses the stream entries of requests that no worker
has taken yet. Their clients would wait until the request timeout for tokens
that never come. The gateway still holds each such request (DESIGN.md: nothing
accepted is lost), so a periodic sweep checks that every QUEUED request's
entry still exists and re-queues the ones missing on two sweeps in a row
(once is not enough: a worker drops an expired entry right after telling the
gateway, and that message may still be on its way). Re-queueing uses a new
attempt number, so a copy that somehow survived is refused by the request table.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from gateway.continuation import ContinuationPolicy
from gateway.errors import InflightError
from gateway.queue import QueueTicket, RequestQueue
from gateway.request_table import RequestState, RequestTable

log = logging.getLogger(__name__)


@dataclass
class QueueWatch:
    """Re-queues QUEUED requests whose entry is gone.

    Args:
        request_table: the gateway's request table (which requests are queued).
        queue: the Redis queue (existence checks).
        policy: re-enqueues (``ContinuationPolicy.requeue``, outcome "requeued").
        every_s: seconds between sweeps.
    """

    request_table: RequestTable
    queue: RequestQueue
    policy: ContinuationPolicy
    every_s: float = 5.0
    _suspects: set[tuple[str, QueueTicket]] = field(default_factory=set)

    async def sweep(self) -> int:
        """One pass; returns how many requests were re-queued.

        Raises:
            UnavailableError: Redis unreachable (nothing changed).
        """
        queued = self.request_table.queued()
        exists = await self.queue.exist([p.ticket for p in queued]) if queued else []
        missing = {(p.request_id, p.ticket): p for p, ok in zip(queued, exists) if not ok}
        confirmed = [p for key, p in missing.items() if key in self._suspects]
        self._suspects = set(missing) - {(p.request_id, p.ticket) for p in confirmed}
        requeued = 0
        for pending in confirmed:
            if pending.state is RequestState.QUEUED and self.request_table.get(pending.request_id) is pending:
                log.warning("queue entry of %s vanished from Redis; queueing it again", pending.request_id)
                await self.policy.requeue(pending, "requeued")
                requeued += 1
        return requeued

    async def run(self) -> None:
        """Sweep every ``every_s`` seconds until cancelled; Redis errors skip a sweep."""
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.sweep()
            except InflightError as exc:
                log.debug("queue sweep skipped: %s", exc.message)
