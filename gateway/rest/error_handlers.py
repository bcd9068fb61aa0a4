"""FastAPI exception handlers: every failure leaves as an OpenAI error body.

Request-validation errors (bad JSON, wrong types) become 400
``invalid_request_error`` naming the parameter, never FastAPI's default 422.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import (InflightError, InternalError, InvalidRequestError, NotFoundError,
                            http_error)
from gateway.metrics import GatewayMetrics
from gateway.rest.anthropic_format import error_body as anthropic_error

log = logging.getLogger(__name__)


#: Routes whose errors take Anthropic's shape (``{"type": "error", "error": {...}}``).
ANTHROPIC_PREFIX = "/v1/messages"


def error_response(err: InflightError, request: Request | None = None) -> JSONResponse:
    """The JSON response for ``err`` (status, OpenAI body, Retry-After when known); under
    ``/v1/messages`` Anthropic's body (``gateway.rest.anthropic_format.error_body``)."""
    if request is not None and request.url.path.startswith(ANTHROPIC_PREFIX):
        status, body, headers = anthropic_error(err)
    else:
        status, body, headers = http_error(err)
    return JSONResponse(body, status_code=status, headers=headers)


#: The names pydantic gives a union's members in an error's ``loc`` (``("stop", "str")``,
#: ``("prompt", "list[int]", 0)``): the type tried, not a field the client sent.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|dict|list|none)$|\[")


def _is_member(part) -> bool:
    return isinstance(part, str) and bool(_UNION_MEMBER.search(part))


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not _is_member(p)]
    return ".".join(parts) or None


def _field_loc(loc: tuple) -> tuple:
    """``loc`` up to its first union member tag (the field the client sent)."""
    for i, part in enumerate(loc):
        if _is_member(part):
            return tuple(loc[:i])
    return tuple(loc)


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """Our error for pydantic/FastAPI's validation failure (first problem reported).

    A body that is empty or not a JSON object is said so in words; a field that takes one of
    several types (``stop``: a string or a list of strings) is named as the client sent it,
    with the types it accepts, not as pydantic's ``stop.str``."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return InvalidRequestError("the request body is not valid JSON", code="invalid_json")
    if loc == ("body",) and first.get("type") == "missing":
        return InvalidRequestError("the request body is empty: send a JSON object", code="invalid_json")
    if loc == ("body",) and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return InvalidRequestError("the request body must be a JSON object")
    param = _param_of(loc)
    text = first.get("msg", "invalid request")
    field = _field_loc(loc)
    if field != loc:
        members = []
        for err in errors:
            err_loc = tuple(err.get("loc", ()))
            if _field_loc(err_loc) == field and len(err_loc) > len(field) and err_loc[len(field)] not in members:
                members.append(err_loc[len(field)])
        text = f"{text} (accepted: {', '.join(str(m) for m in members)})"
    return InvalidRequestError(f"{param}: {text}" if param else text, param=param)


def _unparsed_body(exc: RequestValidationError) -> bool:
    """True when the body as a whole was rejected, as FastAPI does with a body it did
    not parse as JSON (another Content-Type): the first error is at ``("body",)``."""
    errors = exc.errors()
    return bool(errors) and tuple(errors[0].get("loc", ())) == ("body",)


def is_json(content_type: str) -> bool:
    """Whether a ``Content-Type`` header names JSON (``application/json`` or ``*+json``)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def not_json_error() -> InvalidRequestError:
    """The 400 for a body sent without a JSON ``Content-Type`` (``invalid_content_type``)."""
    return InvalidRequestError(
        "the request body must be JSON sent with the header 'Content-Type: application/json' "
        "(curl -d sends application/x-www-form-urlencoded unless told otherwise)",
        code="invalid_content_type")


def install_error_handlers(app: FastAPI, metrics: GatewayMetrics) -> None:
    """Register the handlers on ``app``. Admission rejections are counted by the service;
    body-schema failures (before the service sees the request) are counted here."""

    @app.exception_handler(InflightError)
    async def _inflight(request: Request, exc: InflightError) -> JSONResponse:
        return error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.count_rejection("invalid_request")
        if _unparsed_body(exc) and not is_json(request.headers.get("content-type", "")):
            return error_response(not_json_error(), request)
        return error_response(validation_error(exc), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFoundError("no such route", code="not_found"), request)
        err = InvalidRequestError(str(exc.detail))
        body = error_response(err, request).body
        return JSONResponse(json.loads(body), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the REST front")
        return error_response(InternalError("internal error"), request)
