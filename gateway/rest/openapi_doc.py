"""The served OpenAPI document (``GET /openapi.json``): what each route really answers.

FastAPI documents a 422 for every route with a body or parameters; the gateway never
sends one (``gateway.rest.error_handlers`` turns request-validation failures into 400s),
so :func:`install_openapi` drops it and documents instead, per route, the statuses the
gateway does send, each with OpenAI's error body (``schemas.ErrorResponse``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.rest import schemas

OPENAPI_URL = "/openapi.json"

_WHY = {
    400: "Invalid request: a parameter (named in `param`), a body that is not JSON, a prompt "
         "too long for the context, an unsupported feature.",
    401: "Missing, unknown or revoked API key.",
    404: "Unknown model (or route).",
    413: "Request body too large.",
    429: "A per-key limit (requests/min, tokens/min, in-flight) or the queue is full; "
         "`Retry-After` says when to retry.",
    500: "The worker failed the request.",
    503: "Redis unreachable, no worker alive, the request's worker lost and not resumable; "
         "`Retry-After: 1`.",
    504: "The request did not finish before its deadline.",
}

#: The statuses of a generation route (``/v1/completions``, ``/v1/chat/completions``).
GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503, 504)
MODELS_ERRORS = (401, 503)
MODEL_ERRORS = (401, 404, 503)


def error_responses(*codes: int, body: type = schemas.ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries for ``codes``, each with OpenAI's error body (or
    ``body``: Anthropic's under ``/v1/messages``)."""
    return {code: {"model": body, "description": _WHY[code]} for code in codes}


def generation_responses(stream_chunk: type) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a generation route: 200 as JSON (the route's ``response_model``) or,
    with ``stream: true``, server-sent events of ``stream_chunk`` objects ending with
    ``data: [DONE]``; then the error statuses."""
    sse = {"text/event-stream": {"schema": {
        "type": "string", "description": f"`data: <{stream_chunk.__name__} JSON>` frames, then "
                                         "`data: [DONE]`; a failure mid-stream is a "
                                         "`data: {\"error\": ...}` frame before `[DONE]`."}}}
    return {200: {"content": sse, "description": "The completion (JSON), or its stream (SSE)."},
            **error_responses(*GENERATION_ERRORS)}


def install_openapi(app: FastAPI) -> None:
    """Serve the app's schema at :data:`OPENAPI_URL` without FastAPI's phantom 422s."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description=app.description)
            for operations in doc.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = doc.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
