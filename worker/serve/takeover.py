"""Takeover of gone workers' own streams: nothing routed to a worker waits on it once it
is dead or drained.

The gateway's KV-aware router (gateway/routing/) queues a request on the own stream of
the worker that holds its prompt's prefix (``inflight:requests:{model}:{p}:w:{id}``,
common/redis_keys.py). Every worker registers its id in its model's ``inflight:kv:workers:{model}``.
Once a registered worker has no heartbeat (it died and the key's TTL ran out, or it is draining
and deleted it), every live worker of the same model reads that worker's own streams as well, after its
own and before the shared one (:meth:`StreamConsumer.take_over`); its unacknowledged
entries come back through the usual XAUTOCLAIM after ``claim_idle_ms``
(worker/serve/reclaim.py), as for the shared stream. When all of a gone worker's own
streams are empty, one script deletes them and the registration at once (the gateway
adds to an own stream only with NOMKSTREAM, so a late XADD cannot bring a deleted one
back: it falls back to the shared stream).

The entries a gone worker had read and not acknowledged (held for room, or dialling their
gateway when it died), on the shared streams and its own, are not left to wait out
``claim_idle_ms`` (30 s): once its heartbeat is gone their idle time is set to that
threshold (an ``XCLAIM ... IDLE`` to the same consumer with ``JUSTID``, which is no
delivery), so the next ``XAUTOCLAIM`` of any live worker takes them at once. The heartbeat
is the worker's lease: one frozen past it forgets its held entries when it wakes
(``LeaseWatch``, worker/serve/service.py), and a second delivery is refused by the gateway,
which binds a request to the first ``Accepted``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from common.redis_keys import heartbeat_key, router_workers, stream_name, worker_stream
from worker.serve.consumer import GROUP, StreamConsumer

#: KEYS[1] = the registry set, KEYS[2..] = a gone worker's own streams; ARGV[1] = its id.
#: Deletes the streams and the registration only when every stream is empty; returns 1
#: when it did, 0 when some stream still holds entries.
_FORGET_IF_EMPTY = """
for i = 2, #KEYS do
  if redis.call('XLEN', KEYS[i]) > 0 then return 0 end
end
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[1], ARGV[1])
return 1
"""


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Takeover:
    """Keeps a worker's consumer reading the own streams of its model's registered workers
    that are gone (the registry and streams of ``consumer.model``).

    Args:
        redis: an asyncio Redis client.
        consumer: this worker's stream consumer.
        worker_id: this worker's id (registered at every :meth:`refresh`).
        priorities: the priority classes whose own streams exist.
        every_s: seconds between two looks at the registry.
        claim_idle_ms: the workers' ``XAUTOCLAIM`` idle threshold, milliseconds: a gone
            worker's unacknowledged entries are given this idle time (see the module docstring).
    """

    redis: aioredis.Redis
    consumer: StreamConsumer
    worker_id: str
    priorities: tuple[int, ...]
    every_s: float = 1.0
    claim_idle_ms: int = 30_000
    _next_at: float = 0.0

    async def refresh(self) -> tuple[tuple[int, str], ...]:
        """Register this worker, find the registered workers without a heartbeat, forget
        those whose own streams are empty and take the others over. Does nothing (returns
        ``()``) when it is not yet time to look again.

        Returns:
            The ``(priority, stream)`` pairs now taken over (the gone workers' own streams
            that hold entries).

        Raises:
            redis.exceptions.RedisError: Redis unreachable or refusing a command.
        """
        now = time.monotonic()
        if now < self._next_at:
            return ()
        self._next_at = now + self.every_s
        registry = router_workers(self.consumer.model)
        await self.redis.sadd(registry, self.worker_id)
        others = sorted(_s(m) for m in await self.redis.smembers(registry) if _s(m) != self.worker_id)
        if not others:
            self.consumer.take_over(())
            return ()
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker in others:
                pipe.exists(heartbeat_key(worker))
            alive = await pipe.execute()
        kept: list[tuple[int, str]] = []
        for worker in (w for w, ok in zip(others, alive) if not ok):
            streams = [worker_stream(p, worker, self.consumer.model) for p in self.priorities]
            await self._release_pending(worker, streams)
            if await self.redis.eval(_FORGET_IF_EMPTY, 1 + len(streams), registry, *streams, worker):
                continue
            async with self.redis.pipeline(transaction=False) as pipe:
                for stream in streams:
                    pipe.xlen(stream)
                lengths = await pipe.execute()
            kept += [(p, s) for p, s, n in zip(self.priorities, streams, lengths) if n]
        self.consumer.take_over(tuple(kept))
        return tuple(kept)

    async def _release_pending(self, worker: str, own: list[str]) -> int:
        """Give the entries gone ``worker`` read and did not acknowledge, on its model's shared
        streams and its ``own`` streams, the idle time ``claim_idle_ms``, so the next
        ``XAUTOCLAIM`` takes them (see the module docstring). Returns how many.

        Raises:
            redis.exceptions.RedisError: Redis unreachable (a missing stream or group is skipped).
        """
        released = 0
        for stream in [*(stream_name(p, self.consumer.model) for p in self.priorities), *own]:
            try:
                pending = await self.redis.xpending_range(stream, GROUP, min="-", max="+", count=100,
                                                          consumername=worker)
                ids = [p["message_id"] for p in pending]
                if ids:
                    await self.redis.xclaim(stream, GROUP, worker, 0, ids, idle=self.claim_idle_ms, justid=True)
            except ResponseError as exc:  # NOGROUP: no such stream (an emptied own stream is deleted)
                if "NOGROUP" not in str(exc):
                    raise
                continue
            released += len(ids)
        return released

    async def withdraw(self) -> None:
        """Leave the registry (a clean stop with empty own streams); what is left in them
        is taken over by the others as for a dead worker.

        Raises:
            redis.exceptions.RedisError: as :meth:`refresh`.
        """
        streams = self.consumer.own_streams()
        if streams:
            await self.redis.eval(_FORGET_IF_EMPTY, 1 + len(streams), router_workers(self.consumer.model), *streams,
                                  self.worker_id)
