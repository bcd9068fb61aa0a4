"""Count every REST request by route, status and model (``inflight_gateway_requests_total``;
the model as admission noted it in the request's :func:`gateway.metrics.model_scope`).

A plain ASGI middleware rather than Starlette's ``@app.middleware("http")``: that
one (``BaseHTTPMiddleware``) runs the app in a second task and passes every
response message through a memory stream, which costs a task hop per SSE chunk
and decouples the app's disconnect handling from the real connection.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.metrics import GatewayMetrics, model_scope

UNHANDLED_STATUS = 500  # what Starlette's ServerErrorMiddleware answers to an exception


class RequestCounter:
    """Counts each HTTP request once it ends, labelled by its route template
    (``/v1/completions``; ``unknown`` when no route matched), its status code and its
    served model ("" when refused before it was resolved); a request whose app raised is
    counted as 500."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point: non-HTTP scopes pass through uncounted."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = UNHANDLED_STATUS

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with model_scope():
            try:
                await self.app(scope, receive, send_and_note)
            finally:
                endpoint = getattr(scope.get("route"), "path", "unknown")
                self.metrics.count_request(endpoint, str(status))
