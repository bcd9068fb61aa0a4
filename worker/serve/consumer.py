"""Redis Stream consumer: pulls ``QueuedRequest`` entries with a consumer group.

A worker reads only when it can start the work (see ``WorkerService``), so
Redis, not worker memory, absorbs bursts. Entries are acknowledged (XACK)
only after the gateway has confirmed it received the ``Accepted`` message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from common.redis_keys import GROUP, stream_name, worker_stream
from protos import queue_pb2

__all__ = ["GROUP", "QueueEntry", "StreamConsumer", "group_lost", "stream_name"]


def group_lost(exc: ResponseError) -> bool:
    """True when Redis answered that the consumer group is gone: NOGROUP after Redis
    lost its data (a restart without persistence, FLUSHALL), UNBLOCKED when the stream
    was deleted during a blocking read (Redis 7). The cure is to recreate the group."""
    return "NOGROUP" in str(exc) or "UNBLOCKED" in str(exc)


@dataclass(frozen=True)
class QueueEntry:
    """One pulled stream entry. ``request`` is the decoded protobuf."""

    stream: str
    entry_id: str
    request: queue_pb2.QueuedRequest
    deliveries: int = 1  # times Redis delivered it (> 1 after a reclaim)

    @property
    def expired(self) -> bool:
        """True when the request's deadline (wall clock, seconds) has passed."""
        deadline = self.request.deadline_unix_s
        return deadline > 0 and time.time() > deadline


class StreamConsumer:
    """Reads one model's priority streams highest first as one consumer of the
    ``inflight-workers`` group (``inflight:requests:{model}:{p}``, common/redis_keys.py).

    Within a priority class the order is: this worker's own stream (``own_id``; where the
    gateway's KV-aware router puts requests whose prefix this worker holds), then the own
    streams of gone workers it took over (:meth:`take_over`), then the shared stream.

    Args:
        redis: an asyncio Redis client.
        consumer_name: this consumer's name in the group (the worker id).
        priorities: priority classes, highest first.
        own_id: the worker id whose own streams are read first (None: none).
        model: the id of the model served; only its streams are read.
    """

    def __init__(self, redis: aioredis.Redis, consumer_name: str, priorities: tuple[int, ...],
                 own_id: str | None = None, *, model: str):
        self._redis = redis
        self.model = model
        self._name = consumer_name
        self._priorities = priorities
        self._own = own_id
        self._orphans: tuple[tuple[int, str], ...] = ()  # (priority, stream) taken over
        self._streams = self._order()
        self._groups_ready = False
        self._buffer: list[QueueEntry] = []

    def _order(self) -> list[str]:
        out = []
        for p in self._priorities:
            out += [worker_stream(p, self._own, self.model)] if self._own else []
            out += [stream for priority, stream in self._orphans if priority == p]
            out.append(stream_name(p, self.model))
        return out

    @property
    def streams(self) -> list[str]:
        """Every stream read, in reading order."""
        return list(self._streams)

    def own_streams(self) -> list[str]:
        """This worker's own streams (none without ``own_id``)."""
        return [worker_stream(p, self._own, self.model) for p in self._priorities] if self._own else []

    def take_over(self, streams: tuple[tuple[int, str], ...]) -> None:
        """Read these gone workers' own streams too, ``(priority, stream)`` each, after this
        worker's own stream of that priority, until the next call; ``()`` drops them all."""
        if streams != self._orphans:
            self._orphans = streams
            self._streams = self._order()

    async def lost(self, stream: str) -> None:
        """Redis answered NOGROUP for ``stream``: a taken-over stream is dropped (deleted once
        empty, or Redis lost its data); for any other the groups are created again."""
        if any(s == stream for _, s in self._orphans):
            self.take_over(tuple(o for o in self._orphans if o[1] != stream))
        else:
            await self.ensure_groups()

    async def ensure_groups(self) -> None:
        """Create the consumer group on the shared and own streams (MKSTREAM); an existing
        group is kept. Taken-over streams are never created: when one is gone (deleted once
        empty, or Redis lost its data), it is dropped until the next :meth:`take_over`."""
        self.take_over(())
        for stream in self._streams:
            try:
                await self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_ready = True

    async def read_one(self, block_ms: int | None) -> QueueEntry | None:
        """Read at most one new entry, highest priority first.

        Streams are polled one by one without blocking, in priority order; only
        when all are empty does the call block (``block_ms``) on all of them.
        A blocking read can return one entry per stream: the extras are kept
        (read, unacknowledged, so still reclaimable) and returned next.

        Args:
            block_ms: how long to block when all streams are empty
                (milliseconds); None = do not block.

        Returns:
            The entry, or None when nothing is queued or the entry was malformed
            (a malformed entry is acknowledged and deleted: it can never be served).

        Raises:
            redis.exceptions.ConnectionError: Redis is unreachable.
        """
        if self._buffer:
            return self._buffer.pop(0)
        if not self._groups_ready:
            await self.ensure_groups()
        for stream in self._streams:
            entries = await self._read({stream: ">"}, block=None)
            if entries:
                return entries[0]
        if block_ms is None:
            return None
        entries = await self._read({s: ">" for s in self._streams}, block=block_ms)
        self._buffer.extend(entries[1:])
        return entries[0] if entries else None

    async def _read(self, streams: dict[str, str], block: int | None) -> list[QueueEntry]:
        try:
            reply = await self._redis.xreadgroup(GROUP, self._name, streams, count=1, block=block)
        except ResponseError as exc:
            if not group_lost(exc):
                raise
            (only,) = streams if len(streams) == 1 else (None,)
            if only is not None and any(s == only for _, s in self._orphans):
                self.take_over(tuple(o for o in self._orphans if o[1] != only))  # a taken-over stream is gone
            else:
                self._groups_ready = False  # recreated before the next read
            return []
        order = {s: i for i, s in enumerate(self._streams)}
        decoded = []
        for stream, entries in reply or []:
            for entry_id, fields in entries:
                entry = await self.decode(self._s(stream), entry_id, fields)
                if entry is not None:
                    decoded.append(entry)
        return sorted(decoded, key=lambda e: order.get(e.stream, len(order)))

    async def decode(self, stream: str, entry_id, fields) -> QueueEntry | None:
        """Parse one stream entry; a malformed one is acknowledged, deleted and None returned."""
        entry_id = self._s(entry_id)
        raw = fields.get(b"req") if b"req" in fields else fields.get("req")
        request = queue_pb2.QueuedRequest()
        try:
            request.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - any decode failure means the entry is unusable
            await self.ack(QueueEntry(stream, entry_id, request))
            return None
        return QueueEntry(stream, entry_id, request)

    async def ack(self, entry: QueueEntry) -> None:
        """XACK and XDEL the entry: it is now owned by the gateway that acknowledged it."""
        await self._redis.xack(entry.stream, GROUP, entry.entry_id)
        await self._redis.xdel(entry.stream, entry.entry_id)

    @staticmethod
    def _s(value) -> str:
        return value.decode() if isinstance(value, bytes) else value
