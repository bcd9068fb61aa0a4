"""Recovery of queue entries whose worker died before acknowledging them.

DESIGN.md, "worker dies before XACK": the Redis consumer group owns that
failure. Another worker takes over entries idle for longer than
``claim_idle_ms`` with ``XAUTOCLAIM`` (Redis ≥ 6.2); an entry delivered more
than ``max_deliveries`` times is moved to the dead-letter stream
``inflight:dead:{priority}`` and its client gets an error instead of looping
forever (a request that crashes every worker must not take the fleet down).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from worker.serve.consumer import GROUP, QueueEntry, StreamConsumer, group_lost


def dead_letter_stream(priority: int) -> str:
    """The dead-letter stream of one priority class."""
    return f"inflight:dead:{priority}"


@dataclass(frozen=True)
class ReclaimSettings:
    """Idle threshold (milliseconds), delivery limit and how often to look (seconds)."""

    claim_idle_ms: int = 30_000
    max_deliveries: int = 3
    every_s: float = 1.0


class Reclaimer:
    """Claims idle entries of dead consumers for ``consumer_name``."""

    def __init__(self, redis: aioredis.Redis, consumer: StreamConsumer, consumer_name: str,
                 priorities: tuple[int, ...], settings: ReclaimSettings):
        self._redis = redis
        self._consumer = consumer
        self._name = consumer_name
        self._priorities = priorities
        self._settings = settings
        self._next_at = 0.0
        self._kept: tuple[str, float] = ("", 0.0)  # (entry id, monotonic s) of the last keep-alive

    async def claim(self) -> QueueEntry | None:
        """At most one idle entry, in the consumer's reading order (highest priority
        first; own, taken-over, shared stream), or None (also when it is not yet time
        to look again). The entry's ``deliveries`` counts this one. A
        stream whose group is gone (Redis restarted without its data, FLUSHALL) gets
        the group back, as :meth:`StreamConsumer.read_one` does.

        Raises:
            redis.exceptions.RedisError: Redis is unreachable or refuses the command.
        """
        now = time.monotonic()
        if now < self._next_at:
            return None
        self._next_at = now + self._settings.every_s
        for stream in self._consumer.streams:
            try:
                _, claimed, *_ = await self._redis.xautoclaim(
                    stream, GROUP, self._name, self._settings.claim_idle_ms, start_id="0-0", count=1)
            except ResponseError as exc:
                if not group_lost(exc):
                    raise
                await self._consumer.lost(stream)  # Redis lost its data: a new group has nothing pending
                continue
            for entry_id, fields in claimed:
                if fields is None:  # deleted while pending
                    continue
                entry = await self._consumer.decode(stream, entry_id, fields)
                if entry is not None:
                    self._next_at = 0.0  # there may be more: look again at once
                    return replace(entry, deliveries=await self._deliveries(stream, entry.entry_id))
        return None

    async def _deliveries(self, stream: str, entry_id: str) -> int:
        pending = await self._redis.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
        return int(pending[0]["times_delivered"]) if pending else 1

    def exhausted(self, entry: QueueEntry) -> bool:
        """True when the entry was delivered more often than allowed."""
        return entry.deliveries > self._settings.max_deliveries

    async def dead_letter(self, entry: QueueEntry) -> None:
        """Copy the entry to the dead-letter stream (the caller then acknowledges it)."""
        await self._redis.xadd(dead_letter_stream(entry.request.priority),
                               {"req": entry.request.SerializeToString(), "from": entry.entry_id,
                                "deliveries": str(entry.deliveries)})

    async def keep_alive(self, entry: QueueEntry) -> None:
        """Reset the idle time of an entry this worker holds (waiting for room), so
        no other worker claims it while this one is alive. Called every loop; talks
        to Redis only once per third of ``claim_idle_ms``."""
        now = time.monotonic()
        last_id, last_at = self._kept
        if last_id == entry.entry_id and now - last_at < self._settings.claim_idle_ms / 3000:
            return
        await self._redis.xclaim(entry.stream, GROUP, self._name, 0, [entry.entry_id], justid=True)
        self._kept = (entry.entry_id, now)

    async def release(self, entry: QueueEntry) -> None:
        """Give up an entry this worker holds but will not start (it is draining):
        its idle time is set to the claim threshold, so the next ``XAUTOCLAIM`` of
        any live worker takes it at once instead of after ``claim_idle_ms``."""
        await self.defer(entry, 0.0)

    async def defer(self, entry: QueueEntry, after_s: float) -> None:
        """Give up an entry until ``after_s`` seconds from now: its idle time is set to
        ``claim_idle_ms`` less ``after_s``, so ``XAUTOCLAIM`` hands it out again (to
        any worker, as its next delivery) once that much time has passed. With
        ``JUSTID`` this ``XCLAIM`` does not count as a delivery (Redis docs, XCLAIM)."""
        idle_ms = max(0, self._settings.claim_idle_ms - int(after_s * 1000))
        await self._redis.xclaim(entry.stream, GROUP, self._name, 0, [entry.entry_id],
                                 idle=idle_ms, justid=True)
