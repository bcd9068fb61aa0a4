"""A request-body size cap for the REST front (ASGI middleware).

The nginx edge caps bodies (``client_max_body_size``, 1m by default), but the
gateway also runs without the edge (``inflight up`` when nginx is missing, direct
access inside a cluster). Without a cap, a multi-megabyte prompt or token-id
list is parsed and validated on the event loop for seconds, stalling every other
client. Bodies above the cap get 413 with the same OpenAI error body as the edge
(``code: body_too_large``), before FastAPI parses anything.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from starlette.responses import JSONResponse

from gateway.errors import InvalidRequestError, error_body

MAX_BODY_BYTES = 1 << 20  # 1 MiB, the edge's default client_max_body_size ("1m")

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def too_large(limit_bytes: int) -> JSONResponse:
    """The 413 response for a body above ``limit_bytes`` bytes."""
    err = InvalidRequestError(f"Request body too large (limit {limit_bytes} bytes).",
                              code="body_too_large")
    return JSONResponse(error_body(err), status_code=413)


class BodyLimit:
    """Refuse HTTP request bodies above ``limit_bytes`` bytes with 413.

    A declared ``Content-Length`` above the cap is refused before reading; a chunked
    body is read up to the cap (at most ``limit_bytes`` are buffered) and then handed
    to the app in one message. Later ``receive`` calls (disconnect detection) go to
    the server as usual.

    Args:
        app: the ASGI app to protect.
        limit_bytes: the largest body accepted, in bytes.
    """

    def __init__(self, app, limit_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.limit_bytes = limit_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point: non-HTTP scopes pass through untouched."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit_bytes:
            await too_large(self.limit_bytes)(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit_bytes:
                await too_large(self.limit_bytes)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    """The declared Content-Length in bytes; None when absent or not a number."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
