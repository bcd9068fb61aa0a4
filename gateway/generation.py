"""A submitted request as its client sees it: :class:`Generation`, the events a front (REST,
gRPC) iterates, journaled for a resume (gateway/stream_journal.py) and relayed from another
connection's journal while it relays (gateway/stream_relay.py); and the request's internal id
(:func:`internal_request_id`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

from gateway.admission.ratelimit import Reservation
from gateway.admission.validation import ValidatedRequest
from gateway.errors import DeadlineExceededError, InflightError, UnavailableError, from_worker
from gateway.keys import KeyRecord
from gateway.request_table import PendingRequest
from gateway.stream_journal import LeaseLost, StreamJournal, TakeOver
from gateway.stream_relay import StreamRelay
from protos import common_pb2, link_pb2

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11

log = logging.getLogger(__name__)


class Generation:
    """One submitted request as seen by its client.

    ``request_id`` is the id the client sees (its own, or a generated ``req-…``);
    the queue, the request table and the worker use ``internal_id`` (see :func:`internal_request_id`).
    ``service`` is the gateway's ``gateway.service.GatewayService`` (not imported here: it
    imports this module).
    """

    def __init__(self, service: Any, pending: PendingRequest,
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
        self._lease_lost = False

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
            self._note_lease_lost()
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
        self._note_lease_lost()
        await self._service.request_table.cancel(self.internal_id)
        pending.events.put_nowait(_taken_over(self.request_id))

    def _note_lease_lost(self) -> None:
        """Log and count the lost lease once (the keeper and an append may both find it)."""
        if self._lease_lost:
            return
        self._lease_lost = True
        log.warning("stream %s was taken over by another gateway; its run here is cancelled",
                    self.internal_id, extra={"request_id": self.internal_id})
        self._service.metrics.stream_resumes.labels(how="lease_lost").inc()

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
            if self.journal.broken:  # Redis failed under this stream: its last chunk must not wait on it
                self._service.spawn(self.journal.release())
            else:
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
