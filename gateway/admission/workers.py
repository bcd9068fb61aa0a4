"""Admission refuses work nobody would take: with ``require_worker`` set, a request is
only admitted while some worker's heartbeat key exists in Redis."""

from __future__ import annotations

import time

import redis
import redis.asyncio

from gateway.errors import UnavailableError

WORKER_HEARTBEAT_PATTERN = "inflight:workers:*"
WORKER_CHECK_S = 1.0  # a worker heartbeat seen this recently admits without another SCAN


class WorkerGate:
    """Checks that a worker heartbeat exists (docs/CONTRACTS.md: ``inflight:workers:{id}``).

    Args:
        client: asyncio Redis client.
        require_worker: off = every request passes (tests, a stack started before its workers).
    """

    def __init__(self, client: redis.asyncio.Redis, require_worker: bool):
        self._redis = client
        self._required = require_worker
        self._seen_at = float("-inf")  # monotonic s of the last worker heartbeat seen

    async def check(self) -> None:
        """Pass, or raise when ``require_worker`` is set and no heartbeat key exists; a
        heartbeat seen within ``WORKER_CHECK_S`` seconds passes without another SCAN. A
        Redis error passes too: the rate limiter that comes next reports Redis as unreachable.

        Raises:
            UnavailableError: code ``no_worker``.
        """
        now = time.monotonic()
        if not self._required or now - self._seen_at < WORKER_CHECK_S:
            return
        try:
            async for _ in self._redis.scan_iter(match=WORKER_HEARTBEAT_PATTERN, count=100):
                self._seen_at = now
                return
        except (redis.RedisError, OSError):
            return
        raise UnavailableError("no worker is serving the model right now (none has sent a heartbeat "
                               "in the last 10 s); retry shortly", code="no_worker")
