"""A client-chosen request id (gRPC ``GenerateRequest.request_id``): echoed to the client,
logged and sent to the worker, so it must be short and printable."""

from __future__ import annotations

from gateway.errors import InvalidRequestError

MAX_REQUEST_ID_CHARS = 128


def check_request_id(request_id: str | None) -> str | None:
    """The client-chosen request id, or None (absent or empty: the server makes one).

    Raises:
        InvalidRequestError: longer than 128 characters, or holding control or other
            non-printable characters.
    """
    if not request_id:
        return None
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidRequestError(
            f"'request_id' must be 1 to {MAX_REQUEST_ID_CHARS} printable characters",
            param="request_id")
    return request_id
