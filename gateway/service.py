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
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import redis
import redis.asyncio

from gateway.admission.key_limits import LOWEST_PRIORITY
from gateway.admission.params import RequestParams
from gateway.admission.pipeline import Admission, Decision
from gateway.admission.ratelimit import Reservation
from gateway.admission.validation import PromptTokenizer, ValidatedRequest
from gateway.admission.workers import WORKER_HEARTBEAT_PATTERN
from gateway.continuation import ContinuationPolicy, build_continuation
from gateway.errors import (DeadlineExceededError, InflightError, InvalidRequestError, NotFoundError,
                            UnavailableError, from_worker)
from gateway.keys import KeyRecord
from gateway.metrics import GatewayMetrics
from gateway.model_registry import ModelRegistry, ServedModel, load_models
from gateway.queue import RequestQueue, build_queued_request, stream_name
from gateway.request_table import PendingRequest, RequestTable
from gateway.routing.router import KvRouter
from gateway.settings import GatewaySettings
from gateway.stream_journal import LeaseLost, ResumeError, ResumePoint, StreamJournal, TakeOver, alias_key
from gateway.stream_lease import LeaseKeeper
from gateway.stream_relay import StreamRelay, relay_block_ms
from gateway.tracing import RequestTrace
from protos import common_pb2, link_pb2, queue_pb2

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
        #: ``model_name`` of its metrics: the served model's id (an adapter's base model's).
        self._model_name = request.model_id or request.model
        self._service = service
        self._pending = pending
        self._deadline = deadline_s  # time.monotonic() seconds
        self._started = time.monotonic()
        self._first_token = False
        self._last_token_at = self._started
        self._reservation = reservation
        #: OpenAI's ``x-ratelimit-*`` of the key right after admission (none without limits).
        self.rate_limit_headers: dict[str, str] = (
            reservation.rate_limit.headers() if reservation.rate_limit is not None else {})
        self._delivered_tokens = 0
        self._finished_choices = 0
        #: The request's usage, summed over its choices' ``Finished`` (complete once
        #: :meth:`events` ends): prompt tokens once, completion tokens of every choice.
        self.usage = common_pb2.Usage()
        self._released = False
        self.done = False
        #: The stream's journal in Redis (gateway/stream_journal.py), for a resume through
        #: any gateway; None: not journaled (non-streaming). Each delta is journaled before
        #: it is yielded.
        self.journal: StreamJournal | None = None
        #: Output tokens the client already had when this generation resumed its stream
        #: (0: a new request).
        self.offset = 0
        #: True when this generation resumed a stream (``Last-Event-ID``, gRPC ``Resume``).
        self.resumed = False
        #: True when it replays a finished stream's journal (nothing queued or generated:
        #: no TTFT/token metrics, no tokens charged).
        self.replayed = False
        #: While it relays a stream another connection owns (gateway/stream_relay.py): the
        #: relay (its events are neither journaled nor charged); None once it took the
        #: stream over (a continuation queued here) or for any other generation.
        self.relay: StreamRelay | None = None

    async def events(self) -> AsyncIterator[link_pb2.Delta | link_pb2.Finished]:
        """Deltas, and each choice's ``Finished`` (not for FINISH_REASON_ERROR/ABORT),
        until the last choice's: a request with ``n`` choices yields n of them, each with
        its ``index``, its deltas interleaved with the other choices'. :attr:`usage` is
        the request's once the iteration ends.

        Raises:
            DeadlineExceededError: the request timeout / gRPC deadline passed.
            InflightError: the worker failed it, or its link dropped (UnavailableError).
        """
        while not self.done:
            event, relayed = await self._next()
            if isinstance(event, link_pb2.Delta):
                if not (self.replayed or relayed):
                    self._observe_first_token(len(event.token_ids))
                    self._delivered_tokens += len(event.token_ids)
                    await self._journal(self.journal.append if self.journal is not None else None, event)
                yield event
                continue
            if isinstance(event, InflightError):
                self.done = True
                self._end_trace(error=event)
                await self._release()
                raise event
            self._add_usage(event)
            if event.finish_reason in (common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_ABORT):
                self.done = True
                self._end_trace(finished=event)
                await self._release()
            if event.finish_reason == common_pb2.FINISH_REASON_ERROR:
                raise from_worker(event.error_code, event.error)
            if event.finish_reason == common_pb2.FINISH_REASON_ABORT:
                raise UnavailableError("the worker aborted the request; retry it", code="aborted")
            self._finished_choices += 1
            if not relayed:  # journaled before its finish chunk: a resume then replays it
                await self._journal(self.journal.finish if self.journal is not None else None, event)
            if self._finished_choices >= self.request.n:
                self.done = True
                self._end_trace(finished=event)
                if self.replayed or self.relay is not None:
                    await self._release(0)
                else:
                    await self._release(self.usage.prompt_tokens + self.usage.completion_tokens)
                    self._observe_finish(event)
            yield event

    async def _journal(self, write, event) -> None:
        """``write(event)`` (the journal's append or finish; None: not journaled); a lost
        lease (another gateway took the stream over) ends this run instead."""
        if write is None:
            return
        try:
            await write(event)
        except LeaseLost:
            self.done = True
            error = _taken_over(self.request_id)
            self._end_trace(error=error)
            await self._service.detached(self._cancel_and_release())
            raise error from None

    async def lease_lost(self) -> None:
        """The stream's lease was taken over (gateway/stream_lease.py): cancel this run and
        end the stream with ``stream_taken_over``."""
        pending = self._pending
        if self.done or self._service.request_table.get(self.internal_id) is not pending:
            return
        await self._service.request_table.cancel(self.internal_id)
        pending.events.put_nowait(_taken_over(self.request_id))

    async def _next(self) -> tuple[Any, bool]:
        """``(event, relayed)``: the relay's next event while relaying (a takeover queues the
        continuation here and goes on with its events), else :meth:`_next_event`'s."""
        if self.relay is not None:
            try:
                event = await self._relayed_event()
            except InflightError as exc:
                return exc, True
            if not isinstance(event, TakeOver):
                return event, True
            try:
                await self._service.continue_relay(self, event)
            except InflightError as exc:
                return exc, True
        return await self._next_event(), False

    async def _relayed_event(self) -> Any:
        """The relay's next event within the deadline (DeadlineExceededError after it)."""
        remaining = self._deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self.relay.next(), remaining)
        except (TimeoutError, asyncio.TimeoutError):
            raise DeadlineExceededError("the request did not finish before its deadline") from None

    def _end_trace(self, **outcome) -> None:
        """End the request's spans (gateway/tracing.py) when tracing is on."""
        if self._pending.trace is not None:
            self._pending.trace.end(**outcome)

    def _add_usage(self, finished: link_pb2.Finished) -> None:
        """Fold a choice's usage into the request's as OpenAI counts it: the prompt once
        (choice 0 prefilled it, so its cached count is the prompt's), completion tokens
        summed over the choices."""
        u = finished.usage
        self.usage.prompt_tokens = max(self.usage.prompt_tokens, u.prompt_tokens)
        self.usage.completion_tokens += u.completion_tokens
        if finished.index == 0:
            self.usage.cached_prompt_tokens = u.cached_prompt_tokens

    async def close(self) -> None:
        """Cancel the request unless it already ended (client gone, error, early exit),
        and release its reservation if that has not happened yet."""
        if self._pending.trace is not None:  # tracing: a no-op once the request ended
            self._pending.trace.end(cancelled=not self.done)
        if self.done:
            await self._release()
            return
        self.done = True
        if self.replayed or self.relay is not None:  # nothing runs here; its id is in no request table
            await self._release(0)
            return
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
        if self.journal is not None:  # after the cancel: a resume then takes the stream over at once
            self._service.leases.drop(self.journal)
            await self._service.detached(self.journal.release())
        if used_tokens is None:
            used_tokens = self.request.prompt_tokens + self._delivered_tokens
        await self._service.detached(self._service.admission.release(self._reservation, used_tokens))

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
            self._service.metrics.ttft.labels(self._model_name).observe(now - self._started)
            if self._pending.trace is not None:
                self._pending.trace.first_token()
            num_tokens -= 1
        if num_tokens > 0:
            self._service.metrics.observe_delta(now - self._last_token_at, num_tokens, self._model_name)
        self._last_token_at = now

    def _observe_finish(self, finished: link_pb2.Finished) -> None:
        """Log and count the request once, at its last choice's ``finished``."""
        log.info("finished", extra={"request_id": finished.request_id,
                                    "finish_reason": common_pb2.FinishReason.Name(finished.finish_reason),
                                    "prompt_tokens": self.usage.prompt_tokens,
                                    "completion_tokens": self.usage.completion_tokens,
                                    "choices": self.request.n,
                                    "e2e_s": round(time.monotonic() - self._started, 4)})
        metrics = self._service.metrics
        metrics.e2e.labels(self._model_name).observe(time.monotonic() - self._started)
        metrics.prompt_tokens.labels(self._model_name).inc(self.usage.prompt_tokens)
        metrics.generation_tokens.labels(self._model_name).inc(self.usage.completion_tokens)


def internal_request_id(key: KeyRecord, client_request_id: str | None) -> str:
    """The id a request has in the queue, the request table and the worker.

    A client-chosen id is scoped by its API key (``{key_id}:{id}``), so one tenant can
    neither block nor learn of another tenant's id, and a worker-side cancel can only
    name requests of the key that sent them; without one, ``req-<uuid4 hex>``."""
    if client_request_id:
        return f"{key.key_id}:{client_request_id}"
    return f"req-{uuid.uuid4().hex}"


def _taken_over(request_id: str) -> UnavailableError:
    """The end of a stream whose lease another gateway took over (its client resumed there)."""
    return UnavailableError(f"stream {request_id!r} was resumed on another connection, which now "
                            "delivers it; this one ends", code="stream_taken_over")


@dataclass(frozen=True)
class _Prepared:
    """What ``submit`` builds before admission reserves anything (budget in seconds)."""

    request_id: str
    budget_s: float
    message: queue_pb2.QueuedRequest


class GatewayService:
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

    async def _enqueue_resumed(self, pending: PendingRequest, token_ids: list[int], text: str,
                               attempt: int) -> None:
        """Queue ``pending`` as a continuation after the output its client has (later
        continuations build on it), under ``attempt``."""
        pending.attempt = pending.resumed_attempt = attempt
        pending.delivered_token_ids.extend(token_ids)
        pending.delivered_text.append(text)
        await self._enqueue(pending, build_continuation(pending.message, token_ids, text, attempt, time.time()))

    async def continue_relay(self, gen: Generation, taken: TakeOver) -> None:
        """``gen`` relayed a stream whose owner died and took its lease (``taken``): register
        it here and queue the continuation after everything relayed; its events come from
        the worker from now on, journaled under the lease it took.

        Raises:
            UnavailableError: the id is still in this gateway's table (its old run here has not
                ended yet), or the queue failed.
        """
        relay = gen.relay
        old = gen._pending
        try:
            pending = self.request_table.register(gen.internal_id, gen.request.n)
        except InflightError:
            await relay.journal.release()
            raise UnavailableError(f"stream {gen.request_id!r} is still ending on this gateway; resume again",
                                   code="stream_in_progress") from None
        pending.message, pending.trace = old.message, old.trace
        gen.relay, gen._pending, gen.journal = None, pending, relay.journal
        self.leases.hold(relay.journal, gen.lease_lost)
        log.info("took over", extra={"request_id": gen.internal_id, "offset": len(relay.token_ids)})
        await self._enqueue_resumed(pending, relay.token_ids, relay.text, taken.attempt)

    def _relay(self, key: KeyRecord, resume: ResumePoint, admitted, trace: RequestTrace | None) -> Generation:
        """The generation of a resume of a stream another connection owns: it relays the
        journal (gateway/stream_relay.py), queued nowhere until that owner dies (admitted,
        so counted in the key's request window; released with no tokens used unless it took
        the stream over)."""
        decision = admitted.decision
        pending = PendingRequest(resume.internal_id, choices=max(1, decision.request.n))
        pending.message, pending.trace = admitted.prepared.message, trace
        log.info("relaying", extra={"request_id": resume.internal_id, "tenant": key.tenant,
                                    "key_id": key.key_id, "offset": resume.offset})
        gen = Generation(self, pending, decision.request, time.monotonic() + admitted.prepared.budget_s,
                         admitted.reservation, client_request_id=resume.request_id or resume.internal_id)
        gen.offset, gen.resumed = resume.offset, True
        gen.relay = StreamRelay(self.redis, resume.journal, resume, relay_block_ms(
            self.settings.stream_owner_lease_s, self.settings.redis_timeout_s))
        return gen

    def _replay(self, key: KeyRecord, resume: ResumePoint, admitted, trace: RequestTrace | None) -> Generation:
        """The generation of a resume of a finished stream: the journal's ``resume.replay``
        events, queued nowhere (admitted, so counted in the key's request window; its
        reservation is released with no tokens used)."""
        decision = admitted.decision
        pending = PendingRequest(resume.internal_id, choices=max(1, decision.request.n))
        pending.message, pending.trace = admitted.prepared.message, trace
        for event in resume.replay:
            pending.events.put_nowait(event)
        log.info("replayed", extra={"request_id": resume.internal_id, "tenant": key.tenant,
                                    "key_id": key.key_id, "offset": resume.offset})
        # a fresh budget: the stream's own deadline may have passed since it finished
        gen = Generation(self, pending, decision.request, time.monotonic() + self.settings.request_timeout_s,
                         admitted.reservation, client_request_id=resume.request_id or resume.internal_id)
        gen.offset, gen.resumed, gen.replayed = resume.offset, True, True
        return gen

    def _resumed_message(self, resume: ResumePoint, fresh: queue_pb2.QueuedRequest,
                         model: str) -> queue_pb2.QueuedRequest:
        """The request as first queued, its replies now to this gateway (``fresh``: the one
        the resent body built, which must ask for the same prompt and model; ``model``: the
        name the resent body gave).

        Raises:
            InvalidRequestError: the resent body is not the stream's request
                (``resume_mismatch``).
        """
        original = resume.original
        if list(fresh.prompt_token_ids) != list(original.prompt_token_ids):
            raise InvalidRequestError("Last-Event-ID names a stream of another request: resend the "
                                      "same body to resume it", param="messages", code="resume_mismatch")
        if (fresh.model, fresh.lora_name) != (original.model, original.lora_name) or (
                resume.model and model != resume.model):
            raise InvalidRequestError(f"Last-Event-ID names a stream of model {resume.model or original.model!r}, "
                                      f"not {model!r}: resend the same body to resume it",
                                      param="model", code="resume_mismatch")
        message = queue_pb2.QueuedRequest()
        message.CopyFrom(original)
        message.reply_to = self.settings.reply_to
        if fresh.traceparent:
            message.traceparent = fresh.traceparent
        return message

    async def resume_point(self, key: KeyRecord, request_id: str, offset: int) -> tuple[StreamJournal, ResumePoint]:
        """Where the stream ``request_id`` (the id its client saw) of ``key`` resumes after
        ``offset`` output tokens (gateway/stream_journal.py).

        ``request_id`` is looked up as a REST client's ``X-Request-Id`` (the key's alias of
        it), a gRPC client's own id (scoped by the key: :func:`internal_request_id`), then
        one of ours (``req-…``).

        A stream whose owner lease lives (its gateway, this one too, still streams it) gives a
        ``relay`` point; one nobody owns is taken over here (the point's journal holds the
        lease; see :meth:`StreamJournal.load`).

        Raises:
            NotFoundError: no such stream of this key (never streamed, expired, another key's).
            InvalidRequestError: ``offset`` is not where one of its chunks ended, or ``n`` > 1
                (a stream nobody streams any more and not finished: ``not_resumable``).
            UnavailableError: Redis unreachable.
        """
        ttl = self.settings.stream_resume_ttl_s
        lease_s, owner = self.settings.stream_owner_lease_s, self.settings.reply_to
        try:
            candidates = [internal_request_id(key, request_id)]
            aliased = await StreamJournal.resolve(self.redis, key.key_id, request_id)
            if aliased is not None:
                candidates.insert(0, aliased)
            if request_id.startswith("req-"):
                candidates.append(request_id)
            for internal in candidates:
                try:
                    journal, point = await StreamJournal.load(self.redis, internal, key.key_id, offset, ttl,
                                                              lease_s, owner)
                    return journal, dataclasses.replace(point, request_id=request_id)
                except ResumeError as exc:
                    if exc.code != "not_found" or internal == candidates[-1]:
                        raise
        except ResumeError as exc:
            if exc.code == "not_found":
                raise NotFoundError(f"stream {request_id!r}: {exc}", param="Last-Event-ID",
                                    code="stream_not_found") from exc
            raise InvalidRequestError(f"stream {request_id!r}: {exc}", param="Last-Event-ID",
                                      code="not_resumable") from exc
        except (redis.RedisError, OSError) as exc:
            raise UnavailableError(f"the stream journal is unreachable ({exc}); retry") from exc
        raise AssertionError("unreachable")

    async def start_journal(self, gen: Generation, created: int, key: KeyRecord) -> None:
        """Journal ``gen``'s stream in Redis so its client can resume it through any gateway
        (gateway/stream_journal.py); Redis failures only make it unresumable."""
        if gen.replayed:  # a finished stream's journal is complete
            return
        own = gen.request_id not in (gen.internal_id, internal_request_id(key, gen.request_id))
        alias = alias_key(key.key_id, gen.request_id) if own else None  # a REST X-Request-Id
        if gen.relay is not None:  # journaled by its owner; by this gateway once it takes over
            gen.relay.journal.alias = alias
            return
        pending = self.request_table.get(gen.internal_id)
        if pending is None or pending.message is None:
            return
        gen.journal = StreamJournal(self.redis, gen.internal_id, self.settings.stream_resume_ttl_s, alias,
                                    self.settings.stream_owner_lease_s, self.settings.reply_to)
        await gen.journal.open(pending.message, key.key_id, created, gen.request.model)
        if gen.journal.held:
            self.leases.hold(gen.journal, gen.lease_lost)

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
