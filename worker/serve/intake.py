"""The worker's queue intake: the life of a Redis Stream entry before and after its run.

An entry is read (XREADGROUP, or XAUTOCLAIM of a dead worker's idle one), then
either acknowledged (XACK, once its gateway has the ``Accepted``), kept alive while
it waits for room (XCLAIM), deferred while its gateway cannot be dialled, released
for another delivery, or moved to the dead-letter stream after ``max_deliveries``.

Every Redis call made from the worker's loop is bounded while requests run
(worker/serve/redis_backoff.py), so a sick Redis never stalls running streams, and
after an outage the loop's polling backs off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker.serve.consumer import QueueEntry, StreamConsumer
from worker.serve.metrics import WorkerMetrics
from worker.serve.reclaim import Reclaimer, ReclaimSettings
from worker.serve.redis_backoff import LOOP_REDIS_TIMEOUT_S, RedisBackoff
from worker.serve.settings import WorkerSettings
from worker.serve.takeover import Takeover

log = logging.getLogger(__name__)

#: What a failed Redis call of the loop raises (a bounded call: asyncio's TimeoutError).
REDIS_FAILURES = (RedisError, OSError, asyncio.TimeoutError)
#: The failures that mean Redis is unreachable or hangs, the ones the loop backs off from;
#: an error Redis answered with (a ResponseError) is logged and the loop goes on.
REDIS_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)
T = TypeVar("T")


class Intake:
    """Reads, keeps, defers, releases and acknowledges queue entries for one worker.

    Args:
        redis: an asyncio Redis client.
        settings: the worker's settings (priorities, consumer name, claim idle time,
            max deliveries).
        metrics: the worker's metrics (deferrals are counted).
        busy: True while the engine runs requests: the loop's Redis calls are then
            bounded to ``LOOP_REDIS_TIMEOUT_S`` plus their block time.
        has_room: True when the engine could start one more request; no entry is
            read while it is False.
    """

    def __init__(self, redis: aioredis.Redis, settings: WorkerSettings, metrics: WorkerMetrics,
                 busy: Callable[[], bool], has_room: Callable[[], bool]):
        self._consumer = StreamConsumer(redis, settings.worker_id, settings.priorities, own_id=settings.worker_id,
                                        model=settings.model_id)
        self._takeover = Takeover(redis, self._consumer, settings.worker_id, settings.priorities,
                                  claim_idle_ms=settings.claim_idle_ms)
        self._reclaimer = Reclaimer(redis, self._consumer, settings.worker_id, settings.priorities,
                                    ReclaimSettings(settings.claim_idle_ms, settings.max_deliveries))
        self._backoff = RedisBackoff()  # pause of the loop's Redis polling after a failure
        self._metrics = metrics
        self._busy = busy
        self._has_room = has_room

    async def ensure_groups(self) -> None:
        """Create the consumer groups (MKSTREAM) that do not exist yet."""
        await self._consumer.ensure_groups()

    async def bounded(self, call: Awaitable[T], block_ms: int | None = None) -> T:
        """Await one Redis call of the loop. While requests run it may take at most
        ``LOOP_REDIS_TIMEOUT_S`` plus its block time (worker/serve/redis_backoff.py).

        Raises:
            asyncio.TimeoutError: the bound passed; RedisError/OSError as the call does.
        """
        if not self._busy():
            return await call
        return await asyncio.wait_for(call, LOOP_REDIS_TIMEOUT_S + (block_ms or 0) / 1000)

    async def _poll(self, what: str, call: Callable[[], Awaitable[T]], block_ms: int | None = None,
                    need_room: bool = True) -> T | None:
        """One polling call of the loop (``what``: XAUTOCLAIM, XREADGROUP, ...), bounded, and
        skipped (None) while the backoff after an outage lasts or (``need_room``) the engine is full.
        An outage (connection error, timeout) starts or extends the backoff; an error
        Redis answered with is only logged. Returns the call's result, or None."""
        if (need_room and not self._has_room()) or not self._backoff.allows():
            if block_ms:
                await asyncio.sleep(block_ms / 1000)
            return None
        try:
            result = await self.bounded(call(), block_ms)
        except REDIS_FAILURES as exc:
            if isinstance(exc, REDIS_UNAVAILABLE):
                pause_s = self._backoff.failed()
                log.warning("%s failed (%s): the loop polls Redis again in %.1f s", what, why(exc), pause_s)
            else:
                log.warning("%s failed: %s", what, why(exc))
            return None
        self._backoff.succeeded()
        return result

    async def refresh_streams(self) -> None:
        """Take over the own streams of registered workers that are gone
        (worker/serve/takeover.py); at most once a second, skipped while the engine is full."""
        await self._poll("takeover", self._takeover.refresh)

    async def side_call(self, what: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """A Redis call of the loop that is not about entries (publishing the KV events):
        bounded, skipped during the backoff after an outage, and an outage starts one."""
        return await self._poll(what, call, need_room=False)

    async def withdraw(self) -> None:
        """Leave the own-stream registry when the worker stops (its empty own streams are
        deleted; entries left in them are taken over by the other workers)."""
        try:
            await self.bounded(self._takeover.withdraw())
        except REDIS_FAILURES as exc:
            log.warning("could not leave the worker registry: %s", why(exc))

    async def reclaim(self) -> QueueEntry | None:
        """A dead worker's idle entry (XAUTOCLAIM), or None."""
        return await self._poll("XAUTOCLAIM", self._reclaimer.claim)

    async def pull(self, block_ms: int | None) -> QueueEntry | None:
        """The next new entry (XREADGROUP, blocking at most ``block_ms``), or None."""
        return await self._poll("XREADGROUP", lambda: self._consumer.read_one(block_ms), block_ms)

    def exhausted(self, entry: QueueEntry) -> bool:
        """True when ``entry`` was delivered ``max_deliveries`` times already."""
        return self._reclaimer.exhausted(entry)

    async def dead_letter(self, entry: QueueEntry) -> bool:
        """Move an exhausted entry to the dead-letter stream; False when Redis failed
        (the claimed entry stays pending and is claimed again later)."""
        try:
            await self.bounded(self._reclaimer.dead_letter(entry))
        except REDIS_FAILURES as exc:
            log.warning("could not dead-letter %s: %s", entry.entry_id, why(exc))
            return False
        return True

    async def keep_alive(self, entry: QueueEntry) -> None:
        """Reset the idle time of an entry that waits for room, so nobody reclaims it."""
        try:
            await self.bounded(self._reclaimer.keep_alive(entry))
        except REDIS_FAILURES as exc:
            log.warning("XCLAIM keep-alive failed: %s", why(exc))

    async def defer(self, entry: QueueEntry, after_s: float) -> None:
        """Leave an entry whose gateway could not be dialled for a later delivery,
        ``after_s`` seconds from now. Each deferral costs a delivery, so the entries
        of a gateway that stays gone reach the dead-letter stream after
        ``max_deliveries`` without a prefill; those of a gateway that was cut off
        for a moment run on a later delivery."""
        self._metrics.deferred.inc()
        log.info("gateway %s unreachable: deferring %s by %.1f s (delivery %d)",
                 entry.request.reply_to, entry.request.request_id, after_s, entry.deliveries)
        try:
            await self.bounded(self._reclaimer.defer(entry, after_s))
        except REDIS_FAILURES as exc:  # then it is reclaimed after claim_idle_ms
            log.warning("could not defer %s: %s", entry.entry_id, why(exc))

    async def release(self, entry: QueueEntry) -> None:
        """Hand an entry this worker will not run to the next ``XAUTOCLAIM`` at once."""
        try:
            await self.bounded(self._reclaimer.release(entry))
        except REDIS_FAILURES as exc:  # then it is reclaimed after claim_idle_ms
            log.warning("could not release %s: %s", entry.entry_id, why(exc))

    async def ack(self, entry: QueueEntry, in_loop: bool = True) -> None:
        """XACK an entry; bounded when called from the loop (``in_loop``), not from a
        confirmation task, which holds up nothing and should not give up early. A
        failed XACK leaves the entry pending, delivered again after ``claim_idle_ms``:
        dropped as stale while the request runs here, cancelled by its gateway after."""
        call = self._consumer.ack(entry)
        try:
            await (self.bounded(call) if in_loop else call)
        except REDIS_FAILURES as exc:
            log.warning("XACK of %s failed: %s", entry.entry_id, why(exc))


def why(exc: BaseException) -> str:
    """A failure's message for the log (a bounded call's TimeoutError has none)."""
    return str(exc) or type(exc).__name__
