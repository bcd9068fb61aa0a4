"""The admission → queue → routing pipeline shared by the REST and gRPC fronts.

A front authenticates (``service.admission.authenticate``), builds the
request's :class:`~gateway.admission.params.RequestParams`, submits
(:meth:`GatewayService.submit`: validation, per-key windows, in-flight cap and
queue backpressure in ``gateway.admission.pipeline``, then XADD) and then
iterates :meth:`Generation.events` until its last choice's ``Finished``; it calls
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
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from gateway.admission.key_limits import LOWEST_PRIORITY
from gateway.admission.params import RequestParams
from gateway.admission.pipeline import Admission, Decision
from gateway.admission.validation import PromptTokenizer, ValidatedRequest
from gateway.admission.workers import WORKER_HEARTBEAT_PATTERN
from gateway.continuation import ContinuationPolicy
from gateway.errors import InflightError, InvalidRequestError, UnavailableError
from gateway.generation import Generation, internal_request_id
from gateway.keys import KeyRecord
from gateway.metrics import GatewayMetrics
from gateway.model_registry import ModelRegistry, ServedModel, load_models
from gateway.queue import RequestQueue, build_queued_request, stream_name
from gateway.request_table import PendingRequest, RequestTable
from gateway.routing.router import KvRouter
from gateway.settings import GatewaySettings
from gateway.stream_journal import ResumePoint
from gateway.stream_lease import LeaseKeeper
from gateway.stream_resume import StreamResumes
from gateway.tracing import RequestTrace
from protos import queue_pb2

__all__ = ["Generation", "GatewayService", "internal_request_id"]  # Generation: re-exported for the fronts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Prepared:
    """What ``submit`` builds before admission reserves anything (budget in seconds)."""

    request_id: str
    budget_s: float
    message: queue_pb2.QueuedRequest


class GatewayService(StreamResumes):
    """Shared state of one gateway: settings, Redis, the models (gateway/model_registry.py),
    admission, queue, request table, metrics.

    Args:
        tokenizer: the default model's tokenizer (None: loaded with the others).
        models: every configured model with its tokenizer (None: ``settings.model_specs()``
            loaded, the default one's tokenizer being ``tokenizer`` when given).
    """

    def __init__(self, settings: GatewaySettings, client: redis.asyncio.Redis,
                 tokenizer: PromptTokenizer | None = None, metrics: GatewayMetrics | None = None,
                 tracer: Any = None, *, models: list[ServedModel] | None = None):
        self.settings = settings
        self.redis = client
        if models is None:
            specs = settings.model_specs()
            models = load_models(specs, {specs[0].name: tokenizer} if tokenizer is not None else None)
        self.models = ModelRegistry(client, models)
        self.tokenizer = self.models.default.tokenizer  # the default model's
        self.metrics = metrics or GatewayMetrics()
        self.router = KvRouter(client, settings.router_config(), refused=self.models.refused_workers)
        self.admission = Admission(settings, client, self.models, self.metrics,
                                   queue_streams=self.router.queue_streams)
        self.queue = RequestQueue(client, self.router, self.metrics)
        self.continuations = ContinuationPolicy(self.queue, self.metrics, settings.max_continuations)
        self.request_table = RequestTable(self.queue.remove, on_link_lost=self.continuations,
                                          max_buffered=settings.stream_buffer_events)
        self.continuations.request_table = self.request_table
        self.background: set[asyncio.Future] = set()
        #: Refreshes the owner leases of this gateway's open streams (gateway/stream_lease.py).
        self.leases = LeaseKeeper(settings.stream_owner_lease_s)
        self.tracer = tracer  # an OpenTelemetry Tracer, or None: tracing off (common/tracing.py)

    def tokenizer_of(self, request: ValidatedRequest) -> Any:
        """The tokenizer of ``request``'s model (its base model for an adapter)."""
        model = self.models.models.get(request.model_id or request.model)
        return model.tokenizer if model is not None else self.tokenizer

    def spawn(self, coro) -> None:
        """Run ``coro`` as a task nobody waits for (kept in :attr:`background` until done)."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def detached(self, coro) -> None:
        """Run ``coro`` as a task that survives the caller's cancellation, and wait for it."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        await asyncio.shield(task)

    async def submit(self, key: KeyRecord, params: RequestParams, *,
                     request_id: str | None = None, timeout_s: float | None = None,
                     resume: ResumePoint | None = None, visible_id: str | None = None) -> Generation:
        """Admit a request of the authenticated ``key`` (``Admission.admit``: validation,
        per-key windows, in-flight cap, queue depth), enqueue it and start waiting for its
        tokens.

        ``request_id`` is the client's own id (None: one is made); ``timeout_s`` (seconds
        left when this is called, e.g. the gRPC deadline) shortens the server's request
        timeout. After any error below nothing is queued, reserved or left waiting.
        ``resume`` (a stream resumed through this gateway, gateway/stream_journal.py): the
        request keeps its internal id and deadline; ``params`` must give the same prompt and
        model (the same body). Nothing is queued: a stream that finished (``resume.replay``)
        is replayed from its journal, any other relayed (gateway/stream_relay.py), following
        its owner while the owner's lease lives; once none is held the relay takes the
        stream over and queues a continuation after everything journaled
        (:meth:`continue_relay`). ``visible_id`` (REST: the client's ``X-Request-Id``) is the id
        the client sees (``Generation.request_id``, the SSE ids) while the internal id stays
        a fresh ``req-…``, so it needs to be unique for nobody.

        Raises:
            InvalidRequestError, NotFoundError: a parameter (validation), ``request_id``
                malformed or already in use by this key, the cost exceeds the key's tokens/min,
                or (a resume) the body is another request's (``resume_mismatch``).
            RateLimitError: a per-key window, the in-flight cap or the queue depth.
            UnavailableError: Redis unreachable, or no worker heartbeat while
                ``require_worker``.
        """
        trace = None if self.tracer is None else RequestTrace(self.tracer, key.tenant, key.key_id)
        try:
            return await self._submit(key, params, request_id, timeout_s, trace, resume, visible_id)
        except BaseException as exc:
            if trace is not None:
                trace.end(error=exc)
            raise

    async def _submit(self, key: KeyRecord, params: RequestParams, request_id: str | None,
                      timeout_s: float | None, trace: RequestTrace | None,
                      resume: ResumePoint | None = None, visible_id: str | None = None) -> Generation:
        """:meth:`submit`, with the request's spans (None: tracing off)."""
        called_at = time.monotonic()

        def prepare(decision: Decision) -> _Prepared:
            # Before admission reserves: the id must be free and a message that cannot be
            # built must not hold a slot.
            rid = resume.internal_id if resume is not None else internal_request_id(key, decision.client_request_id)
            if resume is None and self.request_table.get(rid) is not None:
                raise InvalidRequestError(f"request_id {decision.client_request_id!r} is already in use",
                                          param="request_id")
            budget_s = self.settings.request_timeout_s
            if timeout_s is not None:
                budget_s = min(budget_s, max(0.0, timeout_s - (time.monotonic() - called_at)))
            message = build_queued_request(
                rid, decision.request, key, priority=decision.priority,
                deadline_unix_s=time.time() + budget_s, reply_to=self.settings.reply_to,
                cost=decision.cost_tokens)
            if resume is not None:
                message = self._resumed_message(resume, message, decision.request.model)
                budget_s = max(0.0, message.deadline_unix_s - time.time())
            if trace is not None:
                message.traceparent = trace.traceparent
                trace.set_request(rid, decision.request.prompt_tokens, message.sampling.max_tokens,
                                  decision.priority)
            return _Prepared(rid, budget_s, message)

        if trace is not None:
            trace.admission_started()
        admitted = await self.admission.admit(key, params, prepare, request_id=request_id)
        if trace is not None:
            trace.admission_ended()
        rid, reservation = admitted.prepared.request_id, admitted.reservation
        if resume is not None:  # nothing queued: the journal is replayed or relayed
            return self._replay(key, resume, admitted, trace) if resume.finished else self._relay(
                key, resume, admitted, trace)
        try:
            pending = self.request_table.register(rid, admitted.decision.request.n)
        except InflightError:
            await self.admission.release(reservation, 0, rollback=True)
            raise
        pending.message, pending.trace = admitted.prepared.message, trace
        try:
            await self._enqueue(pending, pending.message)
        except BaseException:
            await self.detached(self.admission.release(reservation, 0, rollback=True))
            raise
        decision = admitted.decision
        log.info("queued", extra={"request_id": rid, "tenant": key.tenant, "key_id": key.key_id,
                                  "priority": decision.priority, "cost_tokens": decision.cost_tokens})
        return Generation(self, pending, decision.request, time.monotonic() + admitted.prepared.budget_s,
                          reservation, client_request_id=decision.client_request_id or visible_id)

    async def _enqueue(self, pending: PendingRequest, queued: queue_pb2.QueuedRequest) -> None:
        """XADD ``queued`` for the registered ``pending``; on failure it leaves the table."""
        if pending.trace is not None:
            pending.trace.queued(0)
        try:
            pending.ticket = await self.queue.enqueue(queued)
        except BaseException as exc:
            self.request_table.fail(pending.request_id,
                                    exc if isinstance(exc, InflightError) else UnavailableError(""))
            raise

    async def refresh_queue_depth(self) -> None:
        """Set ``inflight_queue_depth{model_name, priority}`` from XLEN of each model's shared
        stream of each priority plus its routable workers' own streams (acknowledged entries
        are deleted, so XLEN is the backlog), and ``inflight_gateway_redis_up``; Redis errors
        leave the depth as is."""
        try:
            for model in self.models.models:
                for priority in range(LOWEST_PRIORITY + 1):
                    depth = 0
                    for stream in [stream_name(priority, model), *await self.router.queue_streams(priority, model)]:
                        depth += await self.redis.xlen(stream)
                    self.metrics.queue_depth.labels(model_name=model, priority=str(priority)).set(depth)
        except (redis.RedisError, OSError):
            self.metrics.redis_up.set(0)
            return
        self.metrics.redis_up.set(1)

    async def ready(self) -> bool:
        """True when Redis answers and at least one worker heartbeat key exists; sets
        ``inflight_gateway_redis_up``."""
        try:
            async for _ in self.redis.scan_iter(match=WORKER_HEARTBEAT_PATTERN, count=100):
                self.metrics.redis_up.set(1)
                return True
        except (redis.RedisError, OSError):
            self.metrics.redis_up.set(0)
            return False
        self.metrics.redis_up.set(1)
        return False
