"""The worker's side of the gateway link (``inflight.v1.Link/Connect``).

One bidirectional stream per gateway address (a request's ``reply_to``):
worker → gateway ``Hello``, ``Accepted`` and one ``StepOutput`` per engine step;
gateway → worker ``Ack`` (the worker may now XACK) and ``Cancel``.
When a stream breaks, every request of that gateway is aborted (DESIGN.md,
"gateway dies"). The pool remembers for ``UNREACHABLE_S`` seconds an address
whose dial failed (worker/serve/dial_queue.py), so the worker does not prefill the
queued requests of a gateway that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from common.credentials import LINK_SECRET_METADATA
from protos import link_pb2, link_pb2_grpc

log = logging.getLogger(__name__)

ACK_TIMEOUT_S = 10.0
#: Seconds an address stays marked unreachable after a dial to it failed; the
#: next entry for it after that dials again.
UNREACHABLE_S = 5.0


def cancelled_attempt(cancel: link_pb2.Cancel) -> int | None:
    """The ``QueuedRequest.attempt`` ``cancel`` is for, or None when its gateway does not say
    (one that predates ``Cancel.attempt``: the cancel is for whatever attempt runs).
    ``attempt_plus_one`` first (every gateway that knows it sets it), then a nonzero
    ``attempt`` (a gateway that sent only that field: 0 there cannot be told from unset)."""
    if cancel.attempt_plus_one:
        return cancel.attempt_plus_one - 1
    return cancel.attempt or None


class GatewayLink:
    """One stream to one gateway.

    Args:
        address: gateway link address, ``host:port``.
        hello: the first message sent.
        on_cancel: called with a request id, this link's address and the attempt cancelled
            (:func:`cancelled_attempt`: None from a gateway that does not say) when the gateway
            cancels it (a cancel binds only that gateway's run of that attempt: a stream resumed
            through another gateway or this one, gateway/stream_journal.py, keeps the same
            request id).
        on_lost: called with the address once, when the stream ends or fails.
        secret: the link secret, sent as ``x-inflight-link-secret`` metadata (None = none).

    Attributes:
        alive: the stream is open (it may still be connecting: see :meth:`connected`).
    """

    def __init__(self, address: str, hello: link_pb2.Hello,
                 on_cancel: Callable[[str, str, int | None], None], on_lost: Callable[[str], None],
                 secret: str | None = None):
        self.address = address
        self._hello = hello
        self._metadata = ((LINK_SECRET_METADATA, secret),) if secret else None
        self._on_cancel = on_cancel
        self._on_lost = on_lost
        self._outbox: asyncio.Queue[link_pb2.WorkerMessage | None] = asyncio.Queue()
        self._acks: dict[str, asyncio.Future[bool]] = {}
        self._channel: grpc.aio.Channel | None = None
        self._reader: asyncio.Task | None = None
        self.alive = False

    async def open(self) -> None:
        """Dial the gateway and start the stream (does not wait for the connection)."""
        self._channel = grpc.aio.insecure_channel(self.address)
        call = link_pb2_grpc.LinkStub(self._channel).Connect(self._outgoing(), metadata=self._metadata)
        self.alive = True
        self._reader = asyncio.create_task(self._read(call))

    async def _outgoing(self):
        yield link_pb2.WorkerMessage(hello=self._hello)
        while True:
            message = await self._outbox.get()
            if message is None:
                return
            yield message

    async def _read(self, call) -> None:
        try:
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "ack":
                    future = self._acks.pop(message.ack.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(True)
                elif kind == "cancel":
                    self._on_cancel(message.cancel.request_id, self.address, cancelled_attempt(message.cancel))
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                log.error("link to %s refused: the gateway wants another link secret "
                          "(--link-secret-file, INFLIGHT_LINK_SECRET_FILE, INFLIGHT_LINK_SECRET)", self.address)
            else:
                log.warning("link to %s lost: %s", self.address, exc.code().name)
        except asyncio.CancelledError:
            pass
        finally:
            self._lost()

    def _lost(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for future in self._acks.values():
            if not future.done():
                future.set_result(False)
        self._acks.clear()
        self._on_lost(self.address)

    async def connected(self, timeout_s: float) -> bool:
        """Wait until the channel to the gateway is connected.

        Returns:
            True once the channel is READY; False when it fails to connect
            (TRANSIENT_FAILURE, e.g. connection refused), is shut down, or is still
            connecting after ``timeout_s`` seconds.
        """
        if self._channel is None:
            return False
        channel = self._channel
        settled = (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                   grpc.ChannelConnectivity.SHUTDOWN)

        async def settle() -> grpc.ChannelConnectivity:
            state = channel.get_state(try_to_connect=True)
            while state not in settled:
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)
            return state

        try:
            return await asyncio.wait_for(settle(), timeout_s) == grpc.ChannelConnectivity.READY
        except asyncio.TimeoutError:
            return False

    async def accept(self, accepted: link_pb2.Accepted) -> bool:
        """Send ``Accepted`` and wait for the gateway's ``Ack``.

        Returns:
            True once acknowledged; False when the link is lost or no Ack came
            within ``ACK_TIMEOUT_S`` seconds.
        """
        future = asyncio.get_running_loop().create_future()
        self._acks[accepted.request_id] = future
        self.send(link_pb2.WorkerMessage(accepted=accepted))
        try:
            return await asyncio.wait_for(future, ACK_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._acks.pop(accepted.request_id, None)
            return False

    def send(self, message: link_pb2.WorkerMessage) -> None:
        """Queue a message on the stream (dropped when the link is down)."""
        if self.alive:
            self._outbox.put_nowait(message)

    async def close(self) -> None:
        """End the stream cleanly and close the channel."""
        self._outbox.put_nowait(None)
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reader.cancel()
        if self._channel is not None:
            await self._channel.close()


class LinkPool:
    """Keeps one live :class:`GatewayLink` per gateway address, reopening a lost one on
    demand, and remembers for ``UNREACHABLE_S`` seconds the addresses it could not dial."""

    def __init__(self, hello: link_pb2.Hello, on_cancel: Callable[[str, str, int | None], None],
                 on_lost: Callable[[str], None], secret: str | None = None):
        self._hello = hello
        self._secret = secret
        self._on_cancel = on_cancel
        self._on_lost = on_lost
        self._links: dict[str, GatewayLink] = {}
        self._unreachable_until: dict[str, float] = {}  # address -> monotonic s

    def mark_unreachable(self, address: str) -> None:
        """Remember for ``UNREACHABLE_S`` seconds that ``address`` could not be dialled."""
        self._unreachable_until[address] = time.monotonic() + UNREACHABLE_S

    def unreachable_for(self, address: str) -> float:
        """Seconds until ``address`` may be dialled again: > 0 while a failed dial to it
        is less than ``UNREACHABLE_S`` seconds old, else 0.0."""
        until = self._unreachable_until.get(address)
        if until is None:
            return 0.0
        left = until - time.monotonic()
        if left <= 0:
            del self._unreachable_until[address]
            return 0.0
        return left

    async def get(self, address: str) -> GatewayLink:
        """The live link to ``address``, dialling it when there is none."""
        link = self._links.get(address)
        if link is None or not link.alive:
            link = GatewayLink(address, self._hello, self._on_cancel, self._on_lost, self._secret)
            await link.open()
            self._links[address] = link
        return link

    def link(self, address: str) -> GatewayLink | None:
        """The link to ``address`` if it is alive, else None."""
        link = self._links.get(address)
        return link if link is not None and link.alive else None

    async def close(self) -> None:
        """Close every link."""
        await asyncio.gather(*(link.close() for link in self._links.values()), return_exceptions=True)
        self._links.clear()
