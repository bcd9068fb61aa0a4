"""The Redis producer: queued requests go to ``inflight:requests:{priority}``.

Each request is one stream entry with a single field ``req`` holding a
serialized ``inflight.v1.QueuedRequest`` (docs/CONTRACTS.md). The entry id is
kept so a request cancelled while still queued can be XDEL'd.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
import redis.asyncio

from gateway.errors import redis_unavailable
from gateway.keys import KeyRecord
from gateway.admission.validation import ValidatedRequest
from protos import queue_pb2

STREAM_FORMAT = "inflight:requests:{}"
CONSUMER_GROUP = "inflight-workers"


def stream_name(priority: int) -> str:
    """The Redis stream of a priority class (0 = highest)."""
    return STREAM_FORMAT.format(priority)


@dataclass(frozen=True)
class QueueTicket:
    """Where a request sits in Redis: its stream and entry id."""

    stream: str
    entry_id: str


def build_queued_request(request_id: str, request: ValidatedRequest, key: KeyRecord, *,
                         priority: int, deadline_unix_s: float, reply_to: str,
                         cost: int) -> queue_pb2.QueuedRequest:
    """The protobuf a worker reads (deadline/enqueue times in seconds since the epoch)."""
    return queue_pb2.QueuedRequest(
        request_id=request_id, tenant=key.tenant, prompt_token_ids=list(request.prompt_token_ids),
        sampling=request.sampling_params(), priority=priority, deadline_unix_s=deadline_unix_s,
        reply_to=reply_to, enqueued_unix_s=time.time(), model=request.model, key_id=key.key_id,
        cost=cost)


class RequestQueue:
    """XADD/XDEL of queued requests.

    Args:
        client: asyncio Redis client (its timeouts bound how long a Redis outage blocks).
    """

    def __init__(self, client: redis.asyncio.Redis):
        self._redis = client

    async def enqueue(self, message: queue_pb2.QueuedRequest) -> QueueTicket:
        """XADD ``message`` to its priority stream.

        Raises:
            UnavailableError: Redis unreachable or failing.
        """
        stream = stream_name(message.priority)
        try:
            entry_id = await self._redis.xadd(stream, {"req": message.SerializeToString()})
        except (redis.RedisError, OSError) as exc:
            raise redis_unavailable("the request queue", exc) from exc
        return QueueTicket(stream, entry_id.decode() if isinstance(entry_id, bytes) else entry_id)

    async def exist(self, tickets: list[QueueTicket]) -> list[bool]:
        """Whether each entry is still in its stream (one pipelined XRANGE each).

        Raises:
            UnavailableError: Redis unreachable or failing.
        """
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for t in tickets:
                    pipe.xrange(t.stream, t.entry_id, t.entry_id, count=1)
                replies = await pipe.execute()
        except (redis.RedisError, OSError) as exc:
            raise redis_unavailable("the request queue", exc) from exc
        return [bool(r) for r in replies]

    async def retire(self, ticket: QueueTicket) -> None:
        """XDEL an entry a continuation replaces, so the consumer group never redelivers it
        (the request table would refuse its stale attempt anyway). No XACK: the gateway's
        Redis user may not touch the consumer group (docs/SECURITY.md); a worker's next
        XAUTOCLAIM drops the deleted id from the pending list. Redis errors are swallowed:
        the entry is then at worst reclaimed, refused and dropped."""
        try:
            await self._redis.xdel(ticket.stream, ticket.entry_id)
        except (redis.RedisError, OSError):
            pass

    async def remove(self, ticket: QueueTicket) -> bool:
        """XDEL a queued entry; True when it was still there. Redis errors are swallowed
        (returns False): the worker then gets ``Cancel`` after its ``Accepted``."""
        try:
            return bool(await self._redis.xdel(ticket.stream, ticket.entry_id))
        except (redis.RedisError, OSError):
            return False
