"""``x-request-id`` on every REST response, errors included (ASGI middleware).

OpenAI answers every request with an ``x-request-id`` header that support and logs can
be matched on. Ours is, in this order: the client's own ``x-request-id`` echoed back
(when it is 1 to 128 printable ASCII characters, as ``gateway.admission.request_id``
allows for gRPC ids), else the id the route set (a generation's request id, the one
its log lines carry), else a fresh ``req-<uuid4 hex>`` (errors before a request id
exists: 401, 400, 404, 413, 429, 500 ...). A completion takes the client's id as its own
visible id (gateway/rest/app.py), so its body's ``id`` and its SSE ``id:`` lines
(``<id>/<offset>``, what ``Last-Event-ID`` resumes) agree with this header.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.admission.request_id import MAX_REQUEST_ID_CHARS

HEADER = b"x-request-id"


def client_request_id(scope: Scope) -> bytes | None:
    """The request's own ``x-request-id`` when it is usable as ours, else None."""
    for name, value in scope.get("headers", ()):
        if name.lower() == HEADER:
            if 0 < len(value) <= MAX_REQUEST_ID_CHARS and all(0x21 <= b <= 0x7E for b in value):
                return value
            return None
    return None


class RequestIdHeader:
    """Sets ``x-request-id`` on every HTTP response of ``app`` (see the module docstring).
    Wraps the whole app, Starlette's error middleware included, so a 500 carries it too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point: non-HTTP scopes pass through untouched."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        echoed = client_request_id(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                ours = next((v for k, v in headers if k.lower() == HEADER), None)
                value = echoed or ours or f"req-{uuid.uuid4().hex}".encode()
                headers = [(k, v) for k, v in headers if k.lower() != HEADER]
                headers.append((HEADER, value))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
