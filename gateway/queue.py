"""The Redis producer: queued requests go to their model's stream ``inflight:requests:{model}:{priority}``
(``QueuedRequest.model``: the base model's id, common/redis_keys.py), or, when the KV-aware
router (gateway/routing/) finds a worker of that model that holds the prompt's prefix, to that
worker's own stream ``inflight:requests:{model}:{priority}:w:{worker_id}``.

Each request is one stream entry with a single field ``req`` holding a
serialized ``inflight.v1.QueuedRequest`` (docs/CONTRACTS.md). The entry id is
kept so a request cancelled while still queued can be XDEL'd.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
import redis.asyncio

from common.redis_keys import GROUP as CONSUMER_GROUP
from common.redis_keys import stream_name, worker_stream
from gateway.errors import redis_unavailable
from gateway.keys import KeyRecord
from gateway.admission.validation import ValidatedRequest
from gateway.metrics import GatewayMetrics
from gateway.routing.router import KvRouter
from protos import queue_pb2

__all__ = ["CONSUMER_GROUP", "QueueTicket", "RequestQueue", "build_queued_request", "stream_name"]


@dataclass(frozen=True)
class QueueTicket:
    """Where a request sits in Redis: its stream and entry id."""

    stream: str
    entry_id: str


def build_queued_request(request_id: str, request: ValidatedRequest, key: KeyRecord, *,
                         priority: int, deadline_unix_s: float, reply_to: str,
                         cost: int) -> queue_pb2.QueuedRequest:
    """The protobuf a worker reads (deadline/enqueue times in seconds since the epoch);
    ``model`` is the base model's id (it picks the streams), ``lora_name`` the adapter."""
    return queue_pb2.QueuedRequest(
        request_id=request_id, tenant=key.tenant, prompt_token_ids=list(request.prompt_token_ids),
        sampling=request.sampling_params(), priority=priority, deadline_unix_s=deadline_unix_s,
        reply_to=reply_to, enqueued_unix_s=time.time(), model=request.model_id or request.model,
        key_id=key.key_id, cost=cost, lora_name=request.lora_name)


class RequestQueue:
    """XADD/XDEL of queued requests.

    Args:
        client: asyncio Redis client (its timeouts bound how long a Redis outage blocks).
        router: the KV-aware router (None: every request to the shared stream).
        metrics: ``inflight_gateway_routed_total`` is counted here (None: not counted).
    """

    def __init__(self, client: redis.asyncio.Redis, router: KvRouter | None = None,
                 metrics: GatewayMetrics | None = None):
        self._redis = client
        self._router = router
        self._metrics = metrics

    async def enqueue(self, message: queue_pb2.QueuedRequest) -> QueueTicket:
        """XADD ``message`` to the own stream of the worker the router picks, else (no
        router, no worker stands out, or that stream is gone: NOMKSTREAM) to the shared
        stream of its model (``message.model``) and priority.

        Raises:
            UnavailableError: Redis unreachable or failing.
        """
        fields = {"req": message.SerializeToString()}
        try:
            choice = await self._router.route(message) if self._router is not None else None
            shared = stream_name(message.priority, message.model)
            entry_id, stream = None, shared
            if choice is not None and choice.worker_id is not None:
                own = worker_stream(message.priority, choice.worker_id, message.model)
                entry_id = await self._redis.xadd(own, fields, nomkstream=True)
                stream = own if entry_id is not None else stream
            if entry_id is None:
                entry_id = await self._redis.xadd(stream, fields)
        except (redis.RedisError, OSError) as exc:
            raise redis_unavailable("the request queue", exc) from exc
        if self._metrics is not None and self._router is not None and self._router.enabled:
            routed = stream != shared
            self._metrics.routed.labels(target="worker" if routed else "shared").inc()
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
