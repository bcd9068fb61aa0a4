"""FastAPI exception handlers: every failure leaves as an OpenAI error body.

Request-validation errors (bad JSON, wrong types) become 400
``invalid_request_error`` naming the parameter, never FastAPI's default 422.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import (InflightError, InternalError, InvalidRequestError, NotFoundError,
                            http_error)
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


def error_response(err: InflightError) -> JSONResponse:
    """The JSON response for ``err`` (status, OpenAI body, Retry-After when known)."""
    status, body, headers = http_error(err)
    return JSONResponse(body, status_code=status, headers=headers)


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """Our error for pydantic/FastAPI's validation failure (first problem reported)."""
    first = exc.errors()[0] if exc.errors() else {}
    param = _param_of(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return InvalidRequestError("the request body is not valid JSON", code="invalid_json")
    text = first.get("msg", "invalid request")
    return InvalidRequestError(f"{param}: {text}" if param else text, param=param)


def install_error_handlers(app: FastAPI, metrics: GatewayMetrics) -> None:
    """Register the handlers on ``app``. Admission rejections are counted by the service;
    body-schema failures (before the service sees the request) are counted here."""

    @app.exception_handler(InflightError)
    async def _inflight(_: Request, exc: InflightError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejections.labels(reason="invalid_request").inc()
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFoundError("no such route", code="not_found"))
        err = InvalidRequestError(str(exc.detail))
        status, body, _h = http_error(err)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the REST front")
        return error_response(InternalError("internal error"))
