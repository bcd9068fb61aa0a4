"""The admission → queue → routing pipeline shared by the REST and gRPC fronts.

A front authenticates (:meth:`GatewayService.authenticate`), validates
(:meth:`GatewayService.validate`), submits (:meth:`GatewayService.submit`: per-key
windows, in-flight cap and queue backpressure in ``gateway.admission.ratelimit``, then XADD) and
then iterates :meth:`Generation.events` until the final ``Finished``; it calls
:meth:`Generation.close` in a ``finally`` so a client that went away becomes a
``Cancel`` (or an XDEL while still queued). Every end path (finish, error,
cancel, disconnect, deadline, link loss) releases the request's reservation once:
its in-flight slot is freed and the unused tokens are refunded (finish: the
worker's real usage; otherwise prompt + tokens delivered so far).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import redis
import redis.asyncio

from gateway.admission import key_limits as admission
from gateway.continuation import ContinuationPolicy
from gateway.errors import (DeadlineExceededError, InflightError, InvalidRequestError, UnavailableError,
                            from_worker, rejection_reason)
from gateway.keys import KeyRecord, authenticate_async, bearer_token
from gateway.metrics import GatewayMetrics
from gateway.queue import RequestQueue, build_queued_request, stream_name
from gateway.admission.ratelimit import AdmissionPolicy, Limiter, Reservation
from gateway.request_table import PendingRequest, RequestTable
from gateway.settings import GatewaySettings
from gateway.admission.validation import PromptTokenizer, ValidatedRequest, validate_request
from protos import common_pb2, link_pb2

WORKER_HEARTBEAT_PATTERN = "inflight:workers:*"
WORKER_CHECK_S = 1.0  # a worker heartbeat seen this recently admits without another SCAN
INFLIGHT_TTL_MARGIN_S = 30.0
_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11

log = logging.getLogger(__name__)


class Generation:
    """One submitted request as seen by its client.

    ``request_id`` is the id the client sees (its own, or a generated ``req-…``);
    the queue, the request table and the worker use ``internal_id`` (see :func:`internal_request_id`).
    """

    def __init__(self, service: "GatewayService", pending: PendingRequest,
                 request: ValidatedRequest, deadline_s: float, reservation: Reservation,
                 client_request_id: str | None = None):
        self.internal_id = pending.request_id
        self.request_id = client_request_id or pending.request_id
        self.request = request
        self._service = service
        self._pending = pending
        self._deadline = deadline_s  # time.monotonic() seconds
        self._started = time.monotonic()
        self._first_token = False
        self._last_token_at = self._started
        self._reservation = reservation
        self._delivered_tokens = 0
        self._released = False
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
                self._observe_first_token(len(event.token_ids))
                self._delivered_tokens += len(event.token_ids)
                yield event
                continue
            self.done = True
            if isinstance(event, InflightError):
                await self._release()
                raise event
            await self._release(event.usage.prompt_tokens + event.usage.completion_tokens)
            self._observe_finish(event)
            if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
                raise from_worker(event.error_code, event.error)
            if event.finish_reason == common_pb2.FINISH_REASON_ABORT:
                raise UnavailableError("the worker aborted the request; retry it", code="aborted")
            yield event

    async def close(self) -> None:
        """Cancel the request unless it already ended (client gone, error, early exit),
        and release its reservation if that has not happened yet."""
        if self.done:
            await self._release()
            return
        self.done = True
        # A detached task: the cancel must complete even when our caller is being
        # cancelled itself (client disconnect cancels the handler task).
        await self._service.detached(self._cancel_and_release())

    async def _cancel_and_release(self) -> None:
        await self._service.request_table.cancel(self.internal_id)
        await self._release()

    async def _release(self, used_tokens: int | None = None) -> None:
        """Release the reservation once; ``used_tokens`` None = prompt + delivered so far."""
        if self._released:
            return
        self._released = True
        if used_tokens is None:
            used_tokens = self.request.prompt_tokens + self._delivered_tokens
        await self._service.detached(self._service.release(self._reservation, used_tokens))

    async def _next_event(self) -> Any:
        """The next event, or a DeadlineExceededError once the deadline passed (the
        request is then cancelled). An event already queued is taken without waiting;
        ``asyncio.timeout`` (Python >= 3.11) rather than ``wait_for``, which wraps
        every wait in a new task, once per delta."""
        events = self._pending.events
        remaining = self._deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            if not events.empty():
                return events.get_nowait()
            if _timeout is None:  # Python 3.10
                return await asyncio.wait_for(events.get(), remaining)
            async with _timeout(remaining):
                return await events.get()
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
            await self._service.request_table.cancel(self.internal_id)
            return DeadlineExceededError("the request did not finish before its deadline")

    def _observe_first_token(self, num_tokens: int) -> None:
        """TTFT once per request; inter-token latency for every later token."""
        now = time.monotonic()
        if not self._first_token:
            self._first_token = True
            self._service.metrics.ttft.observe(now - self._started)
            num_tokens -= 1
        if num_tokens > 0:
            self._service.metrics.observe_delta(now - self._last_token_at, num_tokens)
        self._last_token_at = now

    def _observe_finish(self, finished: link_pb2.Finished) -> None:
        log.info("finished", extra={"request_id": finished.request_id,
                                    "finish_reason": common_pb2.FinishReason.Name(finished.finish_reason),
                                    "prompt_tokens": finished.usage.prompt_tokens,
                                    "completion_tokens": finished.usage.completion_tokens,
                                    "e2e_s": round(time.monotonic() - self._started, 4)})
        metrics = self._service.metrics
        metrics.e2e.observe(time.monotonic() - self._started)
        metrics.prompt_tokens.inc(finished.usage.prompt_tokens)
        metrics.generation_tokens.inc(finished.usage.completion_tokens)


def internal_request_id(key: KeyRecord, client_request_id: str | None) -> str:
    """The id a request has in the queue, the request table and the worker.

    A client-chosen id is scoped by its API key (``{key_id}:{id}``), so one tenant can
    neither block nor learn of another tenant's id, and a worker-side cancel can only
    name requests of the key that sent them; without one, ``req-<uuid4 hex>``."""
    if client_request_id:
        return f"{key.key_id}:{client_request_id}"
    return f"req-{uuid.uuid4().hex}"


class GatewayService:
    """Shared state of one gateway: settings, Redis, tokenizer, queue, request table, metrics."""

    def __init__(self, settings: GatewaySettings, client: redis.asyncio.Redis,
                 tokenizer: PromptTokenizer, metrics: GatewayMetrics | None = None):
        self.settings = settings
        self.redis = client
        self.tokenizer = tokenizer
        self.metrics = metrics or GatewayMetrics()
        self.queue = RequestQueue(client)
        self.continuations = ContinuationPolicy(self.queue, self.metrics, settings.max_continuations)
        self.request_table = RequestTable(self.queue.remove, on_link_lost=self.continuations)
        self.continuations.request_table = self.request_table
        self.limiter = Limiter(client, AdmissionPolicy(
            inflight_ttl_s=settings.request_timeout_s + INFLIGHT_TTL_MARGIN_S,
            busy_retry_after_s=settings.busy_retry_after_s))
        self.background: set[asyncio.Future] = set()
        self._worker_seen_at = float("-inf")  # monotonic s of the last worker heartbeat seen

    async def detached(self, coro) -> None:
        """Run ``coro`` as a task that survives the caller's cancellation, and wait for it."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        await asyncio.shield(task)

    async def release(self, reservation: Reservation, used_tokens: int,
                      rollback: bool = False) -> None:
        """Release ``reservation`` (see ``Limiter.release``); a Redis failure is logged,
        not raised: the in-flight slot then expires by its TTL."""
        try:
            await self.limiter.release(reservation, used_tokens, rollback)
        except InflightError as exc:
            log.warning("could not release %s: %s", reservation.member, exc.message)

    async def authenticate(self, authorization: str | None) -> KeyRecord:
        """The key record behind an ``Authorization: Bearer <key>`` value.

        Raises:
            AuthenticationError: missing, malformed, unknown or revoked key.
            UnavailableError: Redis unreachable.
        """
        try:
            return await authenticate_async(self.redis, bearer_token(authorization))
        except InflightError as err:
            self._count_rejection(err)
            raise

    def _count_rejection(self, err: InflightError) -> None:
        self.metrics.rejections.labels(reason=rejection_reason(err)).inc()

    async def validate(self, key: KeyRecord, **params: Any) -> ValidatedRequest:
        """Validate request parameters under ``key``'s limits (see ``validate_request``).

        Runs in a worker thread: tokenizing a prompt near the 1 MB body limit takes
        about 0.7 s, and the tokenizer releases the GIL
        (:meth:`common.tokenizer.Tokenizer.encode`), so other requests' streams go
        on meanwhile instead of stalling behind it.

        Raises:
            InvalidRequestError, NotFoundError: the parameter at fault is named.
        """
        try:
            return await asyncio.to_thread(validate_request, self.tokenizer,
                                           admission.limits_for(self.settings, key), **params)
        except InflightError as err:
            self._count_rejection(err)
            raise

    async def submit(self, key: KeyRecord, request: ValidatedRequest, *,
                     request_id: str | None = None, timeout_s: float | None = None) -> Generation:
        """Admit ``request`` (per-key windows, in-flight cap, queue depth), enqueue it and
        start waiting for its tokens.

        ``timeout_s`` (seconds, e.g. the gRPC deadline) shortens the server's request timeout.

        Raises:
            RateLimitError: a per-key window, the in-flight cap or the queue depth (nothing queued).
            InvalidRequestError: ``request_id`` already in use by this key, or the cost exceeds the
                key's tokens/min.
            UnavailableError: Redis unreachable, or no worker heartbeat while
                ``require_worker`` (nothing is left waiting).
        """
        rid = internal_request_id(key, request_id)
        await self._check_workers()
        if self.request_table.get(rid) is not None:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        budget_s = self.settings.request_timeout_s
        if timeout_s is not None:
            budget_s = min(budget_s, max(0.0, timeout_s))
        priority, cost = admission.priority_for(key, request.priority), admission.cost_tokens(request)
        # Built before admission: a message that cannot be built must not hold a slot.
        message = build_queued_request(
            rid, request, key, priority=priority, deadline_unix_s=time.time() + budget_s,
            reply_to=self.settings.reply_to, cost=cost)
        try:
            reservation = await self.limiter.admit(key, cost, stream_name(priority),
                                                   self.settings.queue_limit(priority))
        except InflightError as err:
            self._count_rejection(err)
            raise
        try:
            pending = self.request_table.register(rid)
        except InflightError:
            await self.release(reservation, 0, rollback=True)
            raise
        pending.message = message
        try:
            pending.ticket = await self.queue.enqueue(message)
        except BaseException as exc:
            self.request_table.fail(rid, exc if isinstance(exc, InflightError) else UnavailableError(""))
            await self.detached(self.release(reservation, 0, rollback=True))
            raise
        log.info("queued", extra={"request_id": rid, "tenant": key.tenant, "key_id": key.key_id,
                                  "priority": priority, "cost_tokens": cost})
        return Generation(self, pending, request, time.monotonic() + budget_s, reservation,
                          client_request_id=request_id)

    async def _check_workers(self) -> None:
        """Raise ``UnavailableError`` (code ``no_worker``) when ``require_worker`` is set and no
        worker heartbeat key exists; a heartbeat seen within ``WORKER_CHECK_S`` seconds skips the
        SCAN. A Redis error here passes: admission reports it as Redis being unreachable."""
        now = time.monotonic()
        if not self.settings.require_worker or now - self._worker_seen_at < WORKER_CHECK_S:
            return
        try:
            async for _ in self.redis.scan_iter(match=WORKER_HEARTBEAT_PATTERN, count=100):
                self._worker_seen_at = now
                return
        except (redis.RedisError, OSError):
            return
        err = UnavailableError("no worker is serving the model right now (none has sent a heartbeat "
                               "in the last 10 s); retry shortly", code="no_worker")
        self._count_rejection(err)
        raise err

    async def refresh_queue_depth(self) -> None:
        """Set ``inflight_queue_depth{priority}`` from XLEN of each priority stream
        (acknowledged entries are deleted, so XLEN is the backlog); Redis errors leave it as is."""
        try:
            for priority in range(admission.LOWEST_PRIORITY + 1):
                depth = await self.redis.xlen(stream_name(priority))
                self.metrics.queue_depth.labels(priority=str(priority)).set(depth)
        except (redis.RedisError, OSError):
            pass

    async def ready(self) -> bool:
        """True when Redis answers and at least one worker heartbeat key exists."""
        try:
            async for _ in self.redis.scan_iter(match=WORKER_HEARTBEAT_PATTERN, count=100):
                return True
        except (redis.RedisError, OSError):
            return False
        return False
