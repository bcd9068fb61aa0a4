"""The admission → queue → routing pipeline shared by the REST and gRPC fronts.

A front authenticates (:meth:`GatewayService.authenticate`), validates
(:meth:`GatewayService.validate`), submits (:meth:`GatewayService.submit`) and
then iterates :meth:`Generation.events` until the final ``Finished``; it calls
:meth:`Generation.close` in a ``finally`` so a client that went away becomes a
``Cancel`` (or an XDEL while still queued).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

import redis
import redis.asyncio

from gateway import admission
from gateway.errors import (DeadlineExceededError, InflightError, UnavailableError, from_worker)
from gateway.keys import KeyRecord, authenticate_async, bearer_token
from gateway.metrics import GatewayMetrics
from gateway.queue import RequestQueue, build_queued_request
from gateway.router import PendingRequest, Router
from gateway.settings import GatewaySettings
from gateway.validation import PromptTokenizer, ValidatedRequest, validate_request
from protos import common_pb2, link_pb2

WORKER_HEARTBEAT_PATTERN = "inflight:workers:*"


class Generation:
    """One submitted request as seen by its client."""

    def __init__(self, service: "GatewayService", pending: PendingRequest,
                 request: ValidatedRequest, deadline_s: float):
        self.request_id = pending.request_id
        self.request = request
        self._service = service
        self._pending = pending
        self._deadline = deadline_s  # time.monotonic() seconds
        self._started = time.monotonic()
        self._first_token = False
        self.done = False

    async def events(self) -> AsyncIterator[link_pb2.Delta | link_pb2.Finished]:
        """Deltas, then the final ``Finished`` (not for FINISH_REASON_ERROR/ABORT).

        Raises:
            DeadlineExceededError: the request timeout / gRPC deadline passed.
            InflightError: the worker failed it, or its link dropped (UnavailableError).
        """
        while not self.done:
            event = await self._next_event()
            if isinstance(event, link_pb2.Delta):
                self._observe_first_token()
                yield event
                continue
            self.done = True
            if isinstance(event, InflightError):
                raise event
            self._observe_finish(event)
            if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
                raise from_worker(event.error_code, event.error)
            if event.finish_reason == common_pb2.FINISH_REASON_ABORT:
                raise UnavailableError("the worker aborted the request; retry it", code="aborted")
            yield event

    async def close(self) -> None:
        """Cancel the request unless it already ended (client gone, error, early exit)."""
        if self.done:
            return
        self.done = True
        # A detached task: the cancel must complete even when our caller is being
        # cancelled itself (client disconnect cancels the handler task).
        task = asyncio.ensure_future(self._service.router.cancel(self.request_id))
        self._service.background.add(task)
        task.add_done_callback(self._service.background.discard)
        await asyncio.shield(task)

    async def _next_event(self) -> Any:
        remaining = self._deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self._pending.events.get(), remaining)
        except TimeoutError:
            await self._service.router.cancel(self.request_id)
            return DeadlineExceededError("the request did not finish before its deadline")

    def _observe_first_token(self) -> None:
        if not self._first_token:
            self._first_token = True
            self._service.metrics.ttft.observe(time.monotonic() - self._started)

    def _observe_finish(self, finished: link_pb2.Finished) -> None:
        metrics = self._service.metrics
        metrics.e2e.observe(time.monotonic() - self._started)
        metrics.prompt_tokens.inc(finished.usage.prompt_tokens)
        metrics.generation_tokens.inc(finished.usage.completion_tokens)


class GatewayService:
    """Shared state of one gateway: settings, Redis, tokenizer, queue, router, metrics."""

    def __init__(self, settings: GatewaySettings, client: redis.asyncio.Redis,
                 tokenizer: PromptTokenizer, metrics: GatewayMetrics | None = None):
        self.settings = settings
        self.redis = client
        self.tokenizer = tokenizer
        self.metrics = metrics or GatewayMetrics()
        self.queue = RequestQueue(client)
        self.router = Router(self.queue.remove)
        self.background: set[asyncio.Future] = set()

    async def authenticate(self, authorization: str | None) -> KeyRecord:
        """The key record behind an ``Authorization: Bearer <key>`` value.

        Raises:
            AuthenticationError: missing, malformed, unknown or revoked key.
            UnavailableError: Redis unreachable.
        """
        return await authenticate_async(self.redis, bearer_token(authorization))

    def validate(self, key: KeyRecord, **params: Any) -> ValidatedRequest:
        """Validate request parameters under ``key``'s limits (see ``validate_request``).

        Raises:
            InvalidRequestError, NotFoundError: the parameter at fault is named.
        """
        return validate_request(self.tokenizer, admission.limits_for(self.settings, key), **params)

    async def submit(self, key: KeyRecord, request: ValidatedRequest, *,
                     request_id: str | None = None, timeout_s: float | None = None) -> Generation:
        """Enqueue ``request`` and start waiting for its tokens.

        ``timeout_s`` (seconds, e.g. the gRPC deadline) shortens the server's request timeout.

        Raises:
            UnavailableError: Redis unreachable (nothing is left waiting).
            InvalidRequestError: ``request_id`` already in use.
        """
        rid = request_id or f"req-{uuid.uuid4().hex}"
        budget_s = self.settings.request_timeout_s
        if timeout_s is not None:
            budget_s = min(budget_s, max(0.0, timeout_s))
        pending = self.router.register(rid)
        message = build_queued_request(
            rid, request, key, priority=admission.priority_for(key, request.priority),
            deadline_unix_s=time.time() + budget_s, reply_to=self.settings.reply_to,
            cost=admission.cost_tokens(request))
        try:
            pending.ticket = await self.queue.enqueue(message)
        except BaseException as exc:
            self.router.fail(rid, exc if isinstance(exc, InflightError) else UnavailableError(""))
            raise
        return Generation(self, pending, request, time.monotonic() + budget_s)

    async def ready(self) -> bool:
        """True when Redis answers and at least one worker heartbeat key exists."""
        try:
            async for _ in self.redis.scan_iter(match=WORKER_HEARTBEAT_PATTERN, count=100):
                return True
        except (redis.RedisError, OSError):
            return False
        return False
