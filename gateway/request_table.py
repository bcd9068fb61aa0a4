"""Request id → waiting client: the table of requests whose clients wait for tokens.

The table is the one place that changes a request's :class:`RequestState`:
QUEUED (in Redis) → RUNNING (a worker sent ``Accepted`` on a link) → DONE.
Link sessions push worker messages in; clients read events out of
:attr:`PendingRequest.events` (``link_pb2.Delta``, ``link_pb2.Finished`` or an
``InflightError``); a client that goes away calls :meth:`RequestTable.cancel`.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from gateway.errors import InflightError, InvalidRequestError, UnavailableError
from gateway.queue import QueueTicket
from protos import link_pb2, queue_pb2


class RequestState(enum.Enum):
    """Where a request is: in Redis, on a worker, or ended (changed only by :class:`RequestTable`)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class LinkPeer(Protocol):
    """What the request table needs from a link session (see ``gateway.link_server.LinkSession``)."""

    request_ids: set[str]

    def send_cancel(self, request_id: str) -> None:
        """Queue a ``Cancel`` for ``request_id`` on this link."""
        ...


@dataclass
class PendingRequest:
    """A request whose client is waiting for tokens.

    Attributes:
        message: the queued protobuf (kept to build a continuation after link loss).
        attempt: which queue entry may run it: 0 = the original, n = the n-th
            continuation; a worker's ``Accepted`` for another attempt is refused.
        delivered_token_ids, delivered_text: every token id and text chunk
            routed to the client so far, across attempts.
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
    trace: Any = None  # gateway.tracing.RequestTrace when tracing is on


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
    """

    def __init__(self, remove_queued: Callable[[QueueTicket], Awaitable[bool]],
                 on_link_lost: LinkLossPolicy = fail_with_unavailable):
        self._remove_queued = remove_queued
        self._on_link_lost = on_link_lost
        self._pending: dict[str, PendingRequest] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def register(self, request_id: str) -> PendingRequest:
        """Start waiting for ``request_id``.

        Raises:
            InvalidRequestError: the id is already in use.
        """
        if request_id in self._pending:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      param="request_id")
        pending = self._pending[request_id] = PendingRequest(request_id)
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
        if pending is None or not self._from_owner(pending, session):
            return False
        pending.delivered_token_ids.extend(delta.token_ids)
        if delta.text:
            pending.delivered_text.append(delta.text)
        pending.events.put_nowait(delta)
        return True

    def finish(self, finished: link_pb2.Finished, session: LinkPeer | None = None) -> bool:
        """Hand the final message to its client and forget the request; ignored (False)
        when it came from a link other than the one running the request."""
        pending = self._pending.get(finished.request_id)
        if pending is None or not self._from_owner(pending, session):
            return False
        del self._pending[finished.request_id]
        self._detach(pending)
        pending.events.put_nowait(finished)
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
            session.send_cancel(request_id)
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

    @staticmethod
    def _from_owner(pending: PendingRequest, session: LinkPeer | None) -> bool:
        """True unless the request runs on a link and ``session`` is another one (a
        queued request may be finished by any worker: expired or invalid at pull)."""
        return session is None or pending.session is None or pending.session is session

    @staticmethod
    def _detach(pending: PendingRequest) -> None:
        if pending.session is not None:
            pending.session.request_ids.discard(pending.request_id)
        pending.state, pending.session = RequestState.DONE, None
