"""Authentication before the body, on the REST routes that take one.

FastAPI reads and validates a route's body before calling it, so a bad API key sent with an
invalid body got 400, telling an unauthenticated caller how its body was wrong; OpenAI (and
Anthropic) answer 401 for a bad key whatever the body. :func:`install_auth_first` makes the
router authenticate a POST to those paths from the headers alone first (its error answered by the
app's handlers, as any route's); the key found is left in
:data:`gateway.admission.pipeline.PRE_AUTHENTICATED`, so the route's own
``Admission.authenticate`` of the same value is not a second Redis lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request

from gateway.admission.pipeline import PRE_AUTHENTICATED
from gateway.errors import AuthenticationError
from gateway.rest.api_key import authorization_of

#: The POST routes authenticated first; True where the route reads ``x-api-key`` too
#: (docs/API.md), False where only ``Authorization``.
AUTH_FIRST_PATHS = {
    "/v1/chat/completions": False, "/v1/completions": False, "/v1/responses": False,
    "/v1/messages": True, "/v1/messages/count_tokens": True, "/v1/embeddings": True,
    "/tokenize": True, "/detokenize": True,
}


@dataclass(frozen=True)
class _Refused:
    """The route of a request refused before routing: its path, which is a route's template
    (gateway/rest/request_counter.py labels the request with it)."""

    path: str


def install_auth_first(app: FastAPI, admission: Any) -> None:
    """Authenticate (``admission.authenticate``) before the body on a POST to any path of
    :data:`AUTH_FIRST_PATHS`. It wraps ``app``'s router, inside the exception middleware, so
    an authentication error is answered by the app's handlers as any route's error."""
    app.router.middleware_stack = _auth_first(app.router.middleware_stack, admission)


def _auth_first(inner, admission: Any):
    async def router(scope, receive, send) -> None:
        x_api_key = AUTH_FIRST_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if x_api_key is None or scope.get("method") != "POST":
            await inner(scope, receive, send)
            return
        request = Request(scope)  # the headers only: the body is left for the route
        authorization = authorization_of(request) if x_api_key else request.headers.get("authorization")
        try:
            key = await admission.authenticate(authorization)
        except AuthenticationError as err:  # answered by the app's error handlers; counted under its route
            scope.setdefault("route", _Refused(scope["path"]))
            if x_api_key and err.code == "missing_api_key":  # name the header Anthropic's clients send too
                raise AuthenticationError("missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>'",
                                          code="missing_api_key") from err
            raise
        except Exception:
            scope.setdefault("route", _Refused(scope["path"]))
            raise
        token = PRE_AUTHENTICATED.set((authorization, key))
        try:
            await inner(scope, receive, send)
        finally:
            PRE_AUTHENTICATED.reset(token)
    return router
