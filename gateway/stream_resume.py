"""Resuming a stream (``Last-Event-ID``, gRPC ``Resume``) and journaling one: the part of
:class:`~gateway.service.GatewayService` that deals with gateway/stream_journal.py.

A front asks :meth:`StreamResumes.resume_point` where a stream resumes, submits with it
(``GatewayService.submit(resume=...)``: a finished stream is replayed, any other relayed,
:meth:`StreamResumes._replay` and :meth:`StreamResumes._relay`), and journals every stream it
sends (:meth:`StreamResumes.start_journal`: the record, the owner lease kept by
gateway/stream_lease.py). A relay whose owner died takes the stream over and queues its
continuation here (:meth:`StreamResumes.continue_relay`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import redis

from gateway.continuation import build_continuation
from gateway.errors import InflightError, InvalidRequestError, NotFoundError, UnavailableError
from gateway.generation import Generation, internal_request_id
from gateway.keys import KeyRecord
from gateway.request_table import PendingRequest
from gateway.stream_journal import ResumeError, ResumePoint, StreamJournal, TakeOver, alias_key
from gateway.stream_relay import StreamRelay, relay_block_ms
from gateway.tracing import RequestTrace
from protos import queue_pb2

log = logging.getLogger(__name__)


class StreamResumes:
    """Mixed into ``GatewayService``: uses its ``settings``, ``redis``, ``request_table``,
    ``leases``, ``metrics``, ``detached`` and ``_enqueue``."""

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
        pending.message, pending.trace, pending.owned = old.message, old.trace, relay.journal.refresh
        gen.relay, gen._pending, gen.journal = None, pending, relay.journal
        self.leases.hold(relay.journal, gen.lease_lost)
        self.metrics.stream_resumes.labels(how="taken_over").inc()
        log.info("took over", extra={"request_id": gen.internal_id, "offset": len(relay.token_ids)})
        await self._enqueue_resumed(pending, relay.token_ids, relay.text, taken.attempt)

    def _relay(self, key: KeyRecord, resume: ResumePoint, admitted, trace: RequestTrace | None) -> Generation:
        """The generation of a resume of a stream not finished: it relays the journal
        (gateway/stream_relay.py), following the stream's owner while its lease lives, and is
        queued nowhere until no lease is held (:meth:`continue_relay`). Admitted, so counted
        in the key's request window; released with no tokens used unless it took over."""
        decision = admitted.decision
        pending = PendingRequest(resume.internal_id, choices=max(1, decision.request.n))
        pending.message, pending.trace = admitted.prepared.message, trace
        self.metrics.stream_resumes.labels(how="relayed").inc()
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
        self.metrics.stream_resumes.labels(how="replayed").inc()
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
            pending.owned = gen.journal.refresh
            self.leases.hold(gen.journal, gen.lease_lost)
