"""Reading a reconnect's ``Last-Event-ID`` (and the client's own ``X-Request-Id``) for every
streaming REST route: chat and completions (gateway/rest/app.py), Responses and Messages."""

from __future__ import annotations

import dataclasses

from fastapi import Request

from gateway.errors import InvalidRequestError
from gateway.keys import KeyRecord
from gateway.rest.request_id_header import client_request_id
from gateway.stream_journal import MAX_EVENT_REQUEST_ID_CHARS, ResumePoint, parse_event_id
from protos import link_pb2


async def resume_point_of(service, key: KeyRecord, request: Request, stream: bool | None) -> ResumePoint | None:
    """The point a streamed request resumes from when the client reconnects with
    ``Last-Event-ID`` (gateway/stream_journal.py), else None. ``service`` is the gateway's
    ``GatewayService``; ``stream`` the body's ``stream``. Every REST stream gives its closing
    events ids of their own, ``<request id>/<offset>.<k>`` (chat's and completions' closing
    chunks, gateway/rest/delivery.py ``sse_stream``; the Responses and Messages events,
    gateway/rest/stream_rebuild.py); the point's ``after`` is then ``k``.

    Raises:
        InvalidRequestError: the header is malformed, a ``.<k>`` id at an offset where the
            stream did not end, or the header sent without
            ``stream: true``.
        NotFoundError: no stream of this key has that id.
    """
    header = request.headers.get("last-event-id")
    if header is None:
        return None
    parsed = parse_event_id(header)
    shown = header if len(header) <= 80 else header[:80] + "..."
    if parsed is None:
        raise InvalidRequestError(f"Last-Event-ID {shown!r} is not <request id>/<offset> or "
                                  "<request id>/<offset>.<k> (a request id of "
                                  f"at most {MAX_EVENT_REQUEST_ID_CHARS} printable ASCII characters, "
                                  "an offset of at most 10 digits 0-9, k from 1 to 9999)",
                                  param="Last-Event-ID", code="invalid_last_event_id")
    if not stream:
        raise InvalidRequestError("Last-Event-ID resumes a stream: send it with stream: true",
                                  param="stream")
    request_id, offset, after = parsed
    _journal, point = await service.resume_point(key, request_id, offset)
    if not after:
        return point
    if not point.finished or any(isinstance(event, link_pb2.Delta) for event in point.replay):
        # only a finished stream's closing events, after its last delta, have these ids
        raise InvalidRequestError(f"Last-Event-ID {shown!r} names no event of this stream: "
                                  "events after the last delta only have <offset>.<k> ids",
                                  param="Last-Event-ID", code="invalid_last_event_id")
    return dataclasses.replace(point, after=after)


def visible_id(request: Request) -> str | None:
    """The client's own ``X-Request-Id`` when usable (gateway/rest/request_id_header.py):
    the generation's client-visible id, so the SSE ids and the header agree."""
    found = client_request_id(request.scope)
    return found.decode("ascii") if found is not None else None
