"""Request id → waiting client: the table of requests whose clients wait for tokens.

The table is the one place that changes a request's :class:`RequestState`:
QUEUED (in Redis) → RUNNING (a worker sent ``Accepted`` on a link) → DONE.
Link sessions push worker messages in; clients read events out of
:attr:`PendingRequest.events` (``link_pb2.Delta``, ``link_pb2.Finished``, an embeddings
entry's ``link_pb2.Embedding`` or an
``InflightError``); a client that goes away calls :meth:`RequestTable.cancel`.

A request with ``n`` choices (parallel sampling) gets one ``Finished`` per choice
(each with its ``index``); it stays in the table until the last of them, or until
one of them reports an error or abort, which ends the whole request.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from gateway.errors import InflightError, InvalidRequestError, UnavailableError
from gateway.queue import QueueTicket
from protos import common_pb2, link_pb2, queue_pb2


class RequestState(enum.Enum):
    """Where a request is: in Redis, on a worker, or ended (changed only by :class:`RequestTable`)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class LinkPeer(Protocol):
    """What the request table needs from a link session (see ``gateway.link_server.LinkSession``)."""

    request_ids: set[str]

    def send_cancel(self, request_id: str, attempt: int = 0) -> None:
        """Queue a ``Cancel`` for attempt ``attempt`` of ``request_id`` on this link."""
        ...


@dataclass
class PendingRequest:
    """A request whose client is waiting for tokens.

    Attributes:
        message: the queued protobuf (kept to build a continuation after link loss).
        attempt: which queue entry may run it: 0 = the original, n = the n-th
            continuation; a worker's ``Accepted`` for another attempt is refused.
        delivered_token_ids, delivered_text: every token id and text chunk
            routed to the client so far, across attempts (with n > 1 choices: those of
            every choice, interleaved; a continuation then only asks whether any exist).
        choices: the request's ``n`` (choices sampled; 1 without parallel sampling).
        finished_choices: indexes of the choices whose ``Finished`` was routed.
        resumed_attempt: the attempt a stream resumed through this gateway started at
            (gateway/stream_journal.py); continuations are counted from it (0: not resumed).
        owned: for a journaled stream, awaits True while this gateway still holds its owner
            lease (``StreamJournal.refresh``); a continuation is queued only then, so a
            gateway that woke after another took its stream over runs it nowhere (None: not
            journaled).
    """

    request_id: str
    state: RequestState = RequestState.QUEUED
    ticket: QueueTicket | None = None
    session: LinkPeer | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    message: queue_pb2.QueuedRequest | None = None
    attempt: int = 0
    delivered_token_ids: list[int] = field(default_factory=list)
    delivered_text: list[str] = field(default_factory=list)
    choices: int = 1
    finished_choices: set[int] = field(default_factory=set)
    resumed_attempt: int = 0
    owned: Callable[[], Awaitable[bool]] | None = None
    trace: Any = None  # gateway.tracing.RequestTrace when tracing is on


_ENDS_REQUEST = (common_pb2.FINISH_REASON_ERROR, common_pb2.FINISH_REASON_ABORT)


async def fail_with_unavailable(pending: PendingRequest) -> None:
    """Default link-loss policy: the client gets UNAVAILABLE/503."""
    pending.events.put_nowait(UnavailableError(
        f"the worker running request {pending.request_id} disconnected; retry the request"))


LinkLossPolicy = Callable[[PendingRequest], Awaitable[None]]


class RequestTable:
    """The requests whose clients are waiting: worker output goes to them, their cancels to workers.

    Args:
        remove_queued: XDELs a still-queued request's entry (``RequestQueue.remove``).
        on_link_lost: called for every request a dropped link carried; the default
            fails it with UNAVAILABLE. A re-enqueueing policy (continuation with the
            tokens already delivered) is passed here.
        max_buffered: the most events one request may hold that its client has not taken
            (0: unbounded); a delta beyond it cancels the request and its client gets
            UNAVAILABLE ``slow_consumer``: a reader that cannot keep up holds bounded memory.
    """

    def __init__(self, remove_queued: Callable[[QueueTicket], Awaitable[bool]],
                 on_link_lost: LinkLossPolicy = fail_with_unavailable, max_buffered: int = 0):
        self._remove_queued = remove_queued
        self._on_link_lost = on_link_lost
        self._max_buffered = max_buffered
        self._pending: dict[str, PendingRequest] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def register(self, request_id: str, choices: int = 1) -> PendingRequest:
        """Start waiting for ``request_id``, which samples ``choices`` (its ``n``).

        Raises:
            InvalidRequestError: the id is already in use.
        """
        if request_id in self._pending:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      param="request_id")
        pending = self._pending[request_id] = PendingRequest(request_id, choices=max(1, choices))
        return pending

    def get(self, request_id: str) -> PendingRequest | None:
        """The waiting request, or None when its client is gone or it never existed."""
        return self._pending.get(request_id)

    def queued(self) -> list[PendingRequest]:
        """Requests waiting in Redis (state QUEUED with a queue entry)."""
        return [p for p in self._pending.values() if p.state is RequestState.QUEUED and p.ticket is not None]

    def accept(self, request_id: str, session: LinkPeer, attempt: int = 0) -> bool:
        """A worker took attempt ``attempt`` of the request; False when no client
        waits for it any more or another attempt is the live one (the link then
        answers ``Ack`` followed by ``Cancel``)."""
        pending = self._pending.get(request_id)
        if pending is None or pending.state is not RequestState.QUEUED or pending.attempt != attempt:
            return False
        pending.state, pending.session = RequestState.RUNNING, session
        session.request_ids.add(request_id)
        if pending.trace is not None:
            pending.trace.accepted(attempt)
        return True

    def deliver(self, delta: link_pb2.Delta, session: LinkPeer | None = None) -> bool:
        """Hand a delta to its client; False when nobody waits for it or it came from a
        link other than the one running the request (a stale second delivery)."""
        pending = self._pending.get(delta.request_id)
        if pending is None or self.foreign(delta.request_id, session):
            return False
        if self._max_buffered and pending.events.qsize() >= self._max_buffered:
            del self._pending[delta.request_id]
            if pending.session is not None:
                pending.session.send_cancel(delta.request_id, pending.attempt)
            self._detach(pending)
            pending.events.put_nowait(UnavailableError(
                f"the client of request {delta.request_id} left {self._max_buffered} chunks unread; the "
                "stream was cancelled", code="slow_consumer"))
            return False
        pending.delivered_token_ids.extend(delta.token_ids)
        if delta.text:
            pending.delivered_text.append(delta.text)
        pending.events.put_nowait(delta)
        return True

    def finish(self, finished: link_pb2.Finished, session: LinkPeer | None = None) -> bool:
        """Hand a choice's final message to its client; the request is forgotten after its
        last choice's, or at once when it reports an error or abort (the choices still
        running on the link are then cancelled). Ignored (False) when it came from a link
        other than the one running the request, or repeats a choice already finished."""
        pending = self._pending.get(finished.request_id)
        if pending is None or self.foreign(finished.request_id, session, finishing=True):
            return False
        if finished.index in pending.finished_choices:
            return False
        pending.finished_choices.add(finished.index)
        ends = finished.finish_reason in _ENDS_REQUEST
        if ends or len(pending.finished_choices) >= pending.choices:
            del self._pending[finished.request_id]
            running_on = pending.session
            self._detach(pending)
            if len(pending.finished_choices) < pending.choices and running_on is not None:
                running_on.send_cancel(finished.request_id, pending.attempt)  # the other choices' work is moot
        pending.events.put_nowait(finished)
        return True

    def finish_embedding(self, embedding: link_pb2.Embedding, session: LinkPeer | None = None) -> bool:
        """Hand an embeddings entry's vector to its client; the request is forgotten. Ignored
        (False) when nobody waits for it or it came from a link other than the one running it."""
        pending = self._pending.get(embedding.request_id)
        if pending is None or self.foreign(embedding.request_id, session, finishing=True):
            return False
        del self._pending[embedding.request_id]
        self._detach(pending)
        pending.events.put_nowait(embedding)
        return True

    def fail(self, request_id: str, error: InflightError) -> None:
        """End a request with ``error`` (e.g. its deadline passed at the gateway)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._detach(pending)
            pending.events.put_nowait(error)

    async def cancel(self, request_id: str) -> None:
        """The client went away: XDEL if still queued, else ``Cancel`` on the owning link.

        If the XDEL misses (a worker already read the entry), the worker's later
        ``Accepted`` finds no client and is answered with ``Ack`` + ``Cancel``.
        """
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return
        state, session = pending.state, pending.session
        self._detach(pending)
        if state is RequestState.RUNNING and session is not None:
            session.send_cancel(request_id, pending.attempt)
        elif state is RequestState.QUEUED and pending.ticket is not None:
            await self._remove_queued(pending.ticket)

    def readmit(self, pending: PendingRequest, attempt: int) -> None:
        """Put a request whose link dropped back in the QUEUED state, expecting
        ``attempt`` (a link-loss policy calls this before it enqueues the
        continuation, then sets ``pending.ticket``)."""
        pending.state, pending.session, pending.ticket = RequestState.QUEUED, None, None
        pending.attempt = attempt
        self._pending[pending.request_id] = pending

    async def link_lost(self, session: LinkPeer) -> None:
        """A link dropped: apply the link-loss policy to each request it carried."""
        lost = [self._pending.get(rid) for rid in list(session.request_ids)]
        session.request_ids.clear()
        for pending in lost:
            if pending is None or pending.session is not session:
                continue
            if self._pending.pop(pending.request_id, None) is not None:
                pending.state, pending.session = RequestState.DONE, None
                await self._on_link_lost(pending)

    def foreign(self, request_id: str, session: LinkPeer | None, finishing: bool = False) -> bool:
        """True when output for ``request_id`` from ``session`` must be dropped: the request
        is bound to the link session whose ``Accepted`` the table took, and another session
        sent it; or nobody's ``Accepted`` was taken yet and it is a delta (a stale attempt's,
        or a rogue's). A queued request may still be *finished* by any link (a worker drops
        it at pull: expired, invalid, too many deliveries). False for an unknown id (its
        client is gone: late output after a cancel is normal) and for ``session`` None."""
        pending = self._pending.get(request_id)
        if pending is None or session is None:
            return False
        if pending.session is None:
            return not finishing
        return pending.session is not session

    @staticmethod
    def _detach(pending: PendingRequest) -> None:
        if pending.session is not None:
            pending.session.request_ids.discard(pending.request_id)
        pending.state, pending.session = RequestState.DONE, None
