"""The gateway's one error vocabulary, mapped to HTTP and gRPC in ONE place.

Every failure the gateway reports is an :class:`InflightError` subclass.
:func:`http_error` turns it into an HTTP status, headers and the OpenAI error
body ``{"error": {"message", "type", "param", "code"}}`` (shape from the OpenAI
API reference, "Error codes"); :func:`grpc_status` into a ``grpc.StatusCode``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

log = logging.getLogger(__name__)


class InflightError(Exception):
    """Base of every error the gateway reports to a client.

    Args:
        message: human-readable text, safe to show the client.
        param: the request parameter at fault (OpenAI ``param``), if any.
        code: a short machine code (OpenAI ``code``), if any.

    Attributes:
        headers: extra response headers (HTTP) / initial metadata (gRPC) the error goes out
            with, such as the key's ``x-ratelimit-*`` on an admission rejection.
    """

    kind = "internal"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}


class InvalidRequestError(InflightError):
    """Bad parameters, prompt too long, unknown model in the body: HTTP 400 / INVALID_ARGUMENT."""

    kind = "invalid_request"


class AuthenticationError(InflightError):
    """Missing, unknown or revoked API key: HTTP 401 / UNAUTHENTICATED."""

    kind = "authentication"


class PermissionDeniedError(InflightError):
    """A valid key that may not do this: HTTP 403 / PERMISSION_DENIED."""

    kind = "permission"


class NotFoundError(InflightError):
    """Unknown model or route: HTTP 404 / NOT_FOUND."""

    kind = "not_found"


class ModelNotFoundError(NotFoundError):
    """A ``model`` no worker serves and no configuration names: HTTP 404 / NOT_FOUND with
    OpenAI's body for it (type ``invalid_request_error``, param ``model``, code
    ``model_not_found``)."""

    kind = "model_not_found"

    def __init__(self, model: str):
        shown = model if len(model) <= 200 else model[:200] + "…"  # a 100 KB name is not echoed whole
        super().__init__(f"The model `{shown}` does not exist or you do not have access to it.",
                         param="model", code="model_not_found")


class RateLimitError(InflightError):
    """A limit was hit: HTTP 429 + ``Retry-After`` / RESOURCE_EXHAUSTED.

    Args:
        retry_after_s: seconds after which a retry may succeed (None = unknown).
    """

    kind = "rate_limit"

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kw):
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class UnavailableError(InflightError):
    """Redis unreachable, link lost, shutting down: HTTP 503 / UNAVAILABLE."""

    kind = "unavailable"


class DeadlineExceededError(InflightError):
    """The request's deadline passed (in the queue or while generating): HTTP 504 / DEADLINE_EXCEEDED."""

    kind = "deadline_exceeded"


class InternalError(InflightError):
    """A bug or a worker-side failure: HTTP 500 / INTERNAL."""

    kind = "internal"


@dataclass(frozen=True)
class _Mapping:
    http_status: int
    openai_type: str
    grpc_code: grpc.StatusCode


_TABLE: dict[str, _Mapping] = {
    "invalid_request": _Mapping(400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
    "authentication": _Mapping(401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED),
    "permission": _Mapping(403, "permission_error", grpc.StatusCode.PERMISSION_DENIED),
    "not_found": _Mapping(404, "not_found_error", grpc.StatusCode.NOT_FOUND),
    "model_not_found": _Mapping(404, "invalid_request_error", grpc.StatusCode.NOT_FOUND),
    "rate_limit": _Mapping(429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
    "unavailable": _Mapping(503, "service_unavailable_error", grpc.StatusCode.UNAVAILABLE),
    "deadline_exceeded": _Mapping(504, "timeout_error", grpc.StatusCode.DEADLINE_EXCEEDED),
    "internal": _Mapping(500, "server_error", grpc.StatusCode.INTERNAL),
}

# Worker-side Finished.error_code values (see protos/link.proto) -> error classes.
_BY_WORKER_CODE: dict[str, type[InflightError]] = {
    "invalid_request": InvalidRequestError,
    "deadline_exceeded": DeadlineExceededError,
    "internal": InternalError,
}


def error_body(err: InflightError) -> dict:
    """The OpenAI error body for ``err``: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": err.message,
            "type": _TABLE[err.kind].openai_type,
            "param": err.param,
            "code": err.code,
        }
    }


def redis_unavailable(what: str, exc: BaseException) -> UnavailableError:
    """The error a client gets when Redis fails under ``what`` ("the request queue", ...).

    The Redis error itself (addresses, socket paths) is logged here, never shown to
    the client."""
    log.warning("%s: Redis failed: %s", what, exc)
    return UnavailableError(f"{what} is unavailable (Redis unreachable); retry shortly", code="redis_unavailable")


def http_error(err: InflightError) -> tuple[int, dict, dict[str, str]]:
    """``(status, body, headers)`` for ``err``: its own ``headers``, plus ``Retry-After``
    (whole seconds) from the window on rate limits, ``Retry-After: 1`` on 503s (RFC 9110 §10.2.3)."""
    headers: dict[str, str] = dict(err.headers)
    if isinstance(err, RateLimitError) and err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    elif isinstance(err, UnavailableError):
        headers["Retry-After"] = "1"
    return _TABLE[err.kind].http_status, error_body(err), headers


def grpc_status(err: InflightError) -> grpc.StatusCode:
    """The gRPC status code for ``err``."""
    return _TABLE[err.kind].grpc_code


def grpc_details(err: InflightError) -> str:
    """The gRPC status message for ``err``: the message, plus the parameter and retry hint."""
    text = err.message
    if err.param and err.param not in text:
        text = f"{text} (param: {err.param})"
    if isinstance(err, RateLimitError) and err.retry_after_s is not None and "retry after" not in text:
        text = f"{text}; retry after {err.retry_after_s:.1f} s"
    return text


_PROMPT_PARAMS = ("prompt", "messages")


def rejection_reason(err: InflightError) -> str:
    """The ``reason`` label of ``inflight_gateway_rejections_total`` for an admission error:
    ``auth``, ``max_tokens``, ``prompt_tokens``, ``key_rate``, ``key_tokens``, ``in_flight``,
    ``queue_full``; other errors keep their code (or kind)."""
    if isinstance(err, AuthenticationError):
        return "auth"
    if err.code == "key_tokens" or isinstance(err, RateLimitError) and err.code:
        return err.code
    if isinstance(err, InvalidRequestError) and err.param == "max_tokens":
        return "max_tokens"
    if isinstance(err, InvalidRequestError) and err.param in _PROMPT_PARAMS \
            and err.code == "context_length_exceeded":
        return "prompt_tokens"
    return err.code or err.kind


def grpc_trailers(err: InflightError) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata for ``err`` on rate limits, nothing otherwise:

    - ``grpc-status-details-bin``: a ``google.rpc.Status`` carrying a
      ``google.rpc.RetryInfo`` with the wait (the standard way to say when to retry,
      AIP-194 / google/rpc/error_details.proto; ``grpc_status.rpc_status.from_call``
      reads it on the client);
    - ``retry-after-s``: the same wait in whole seconds, like HTTP's ``Retry-After``,
      for clients that only read plain metadata.
    """
    if not isinstance(err, RateLimitError) or err.retry_after_s is None:
        return ()
    seconds = max(1, math.ceil(err.retry_after_s))
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds))
    detail = any_pb2.Any()
    detail.Pack(retry)
    status = status_pb2.Status(code=grpc_status(err).value[0], message=grpc_details(err), details=[detail])
    return (("grpc-status-details-bin", status.SerializeToString()), ("retry-after-s", str(seconds)))


def from_worker(error_code: str, message: str) -> InflightError:
    """The error for a worker ``Finished`` with FINISH_REASON_ERROR (unknown codes → internal)."""
    cls = _BY_WORKER_CODE.get(error_code, InternalError)
    return cls(message or "the worker failed the request", code=error_code or None)
