"""The link server: workers dial it (``reply_to``) and stream token output back.

Protocol (docs/CONTRACTS.md, protos/link.proto): the worker opens one
``Link.Connect`` stream per gateway, sends ``Hello``, then per request
``Accepted`` (answered with ``Ack``; ``Ack`` + ``Cancel`` when the client is
already gone) and at most one ``StepOutput`` per engine step (deltas, then
finishes; a delta holds several tokens under the worker's ``--stream-interval``).
The gateway sends ``Cancel`` when a client goes away.

Authentication (docs/SECURITY.md): with a link secret configured, a ``Connect``
whose ``x-inflight-link-secret`` metadata is missing or wrong ends with
UNAUTHENTICATED before any message is read (constant-time comparison). Output is
bound to the session whose ``Accepted`` the request table took: a ``StepOutput``
entry for a request another session runs is dropped, logged and counted
(``inflight_gateway_link_rejections_total{reason="foreign_request"}``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import grpc

from common.credentials import LINK_SECRET_METADATA
from gateway.metrics import GatewayMetrics
from gateway.request_table import RequestTable
from gateway.routing.router import KvRouter
from protos import link_pb2, link_pb2_grpc

log = logging.getLogger(__name__)


class LinkSession:
    """One worker's stream: its outbox and the requests it runs for this gateway.

    Args:
        peer: the worker's address as gRPC reports it (for logs).
    """

    def __init__(self, peer: str):
        self.peer = peer
        self.worker_id = ""
        self.request_ids: set[str] = set()
        self.outbox: asyncio.Queue[link_pb2.GatewayMessage | None] = asyncio.Queue()

    def send_ack(self, request_id: str) -> None:
        """Queue ``Ack(request_id)`` for the worker."""
        self.outbox.put_nowait(link_pb2.GatewayMessage(ack=link_pb2.Ack(request_id=request_id)))

    def send_cancel(self, request_id: str, attempt: int = 0) -> None:
        """Queue ``Cancel(request_id, attempt)`` for the worker (``attempt``: the run's
        ``QueuedRequest.attempt``, sent as ``attempt`` and ``attempt_plus_one``; a worker that
        runs a newer attempt of it, such as a resume's continuation, ignores it, and one that
        no longer runs it drops a later delivery of that attempt only)."""
        self.outbox.put_nowait(link_pb2.GatewayMessage(cancel=link_pb2.Cancel(
            request_id=request_id, attempt=attempt, attempt_plus_one=attempt + 1)))

    def close(self) -> None:
        """End the gateway → worker direction."""
        self.outbox.put_nowait(None)


class LinkService(link_pb2_grpc.LinkServicer):
    """``inflight.v1.Link`` servicer handing worker messages to a :class:`RequestTable`."""

    def __init__(self, request_table: RequestTable, secret: str | None = None,
                 metrics: GatewayMetrics | None = None, router: KvRouter | None = None):
        self._table = request_table
        self._secret = secret.encode() if secret else None
        self._metrics = metrics or GatewayMetrics()
        self._router = router  # told when a worker links and when its last link drops
        self.sessions: set[LinkSession] = set()
        self._recoveries: set[asyncio.Future] = set()  # link-loss handling in progress

    def _authenticated(self, context: grpc.aio.ServicerContext) -> bool:
        if self._secret is None:
            return True
        offered = b""
        for key, value in context.invocation_metadata() or ():
            if key == LINK_SECRET_METADATA:
                offered = value.encode() if isinstance(value, str) else bytes(value)
        return hmac.compare_digest(offered, self._secret)

    def _reject(self, reason: str) -> None:
        self._metrics.link_rejections.labels(reason).inc()

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):
        """One worker's bidirectional stream; when it ends, the request table's link-loss
        policy runs for every request the link carried. Refused (UNAUTHENTICATED, nothing
        read) without the right secret when one is configured."""
        if not self._authenticated(context):
            self._reject("unauthenticated")
            log.warning("link from %s refused: missing or wrong link secret", context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "link secret missing or wrong")
            return
        session = LinkSession(context.peer())
        self.sessions.add(session)
        reader = asyncio.create_task(self._read(session, request_iterator))
        try:
            while (message := await session.outbox.get()) is not None:
                yield message
        finally:
            reader.cancel()
            self.sessions.discard(session)
            log.info("link from %s (%s) closed", session.worker_id or "?", session.peer)
            if self._router is not None and not any(s.worker_id == session.worker_id for s in self.sessions):
                # before the continuations below are routed: not back to a dead worker's own stream
                self._router.link_lost(session.worker_id)
            # Detached and shielded: gRPC cancels this handler again while the link-loss
            # policy awaits Redis, which stopped it after the first continuation.
            recovery = asyncio.ensure_future(self._table.link_lost(session))
            self._recoveries.add(recovery)
            recovery.add_done_callback(self._recoveries.discard)
            await asyncio.shield(recovery)

    async def _read(self, session: LinkSession, request_iterator) -> None:
        try:
            async for message in request_iterator:
                self._handle(session, message)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        except Exception:  # a bug here must not leave the stream half-open
            log.exception("link reader failed")
        finally:
            session.close()

    def _handle(self, session: LinkSession, message: link_pb2.WorkerMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "hello":
            session.worker_id = message.hello.worker_id
            log.info("worker %s linked from %s", session.worker_id, session.peer)
            if self._router is not None:
                self._router.link_up(session.worker_id)
        elif kind == "accepted":
            rid = message.accepted.request_id
            waiting = self._table.accept(rid, session, message.accepted.attempt)
            session.send_ack(rid)
            if not waiting:
                session.send_cancel(rid, message.accepted.attempt)
        elif kind == "step":
            for delta in message.step.deltas:
                if not self._foreign(session, delta.request_id, finishing=False):
                    self._table.deliver(delta, session)
            for finished in message.step.finished:
                if not self._foreign(session, finished.request_id, finishing=True):
                    self._table.finish(finished, session)
            for embedding in message.step.embeddings:  # each ends its embeddings entry
                if not self._foreign(session, embedding.request_id, finishing=True):
                    self._table.finish_embedding(embedding, session)

    def _foreign(self, session: LinkSession, request_id: str, finishing: bool) -> bool:
        if not self._table.foreign(request_id, session, finishing):
            return False
        self._reject("foreign_request")
        log.warning("dropped %s for request %s from %s (%s): another link session runs it",
                    "Finished" if finishing else "a delta", request_id, session.worker_id or "?", session.peer)
        return True


def add_link_service(server: grpc.aio.Server, request_table: RequestTable, secret: str | None = None,
                     metrics: GatewayMetrics | None = None, router: KvRouter | None = None) -> LinkService:
    """Register the link servicer on ``server`` and return it; ``secret`` None: no
    authentication (a warning is logged); ``router`` (the KV router) stops routing to a
    worker whose link dropped (:meth:`KvRouter.link_lost`)."""
    if not secret:
        log.warning("no link secret configured (--link-secret-file, INFLIGHT_LINK_SECRET_FILE or "
                    "INFLIGHT_LINK_SECRET): any process that reaches the link port can stream output "
                    "for requests it learns the id of")
    service = LinkService(request_table, secret, metrics, router)
    link_pb2_grpc.add_LinkServicer_to_server(service, server)
    return service
