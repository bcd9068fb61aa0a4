"""The SSE frames of one streamed ``/v1/responses`` request, resumable (``Last-Event-ID``).

:class:`ResponseEvents` frames the events of ``gateway.rest.responses_output`` in groups,
one per delta (and one for the start, one for the end), every frame with its ``id:`` line
``<request id>/<output tokens so far>`` (the end's ``<request id>/<offset>.<k>``, k = 1, 2,
...) and its ``sequence_number``. A resume rebuilds the
stream as the client has it (:meth:`ResponseEvents.restore`: the same items, ids and
sequence numbers, gateway/rest/stream_rebuild.py) and sends only what follows.
"""

from __future__ import annotations

from typing import Any, Iterable

from gateway.rest.responses_output import EventWriter, OutputBuilder
from gateway.rest.stream_rebuild import closing_frames, with_id


class ResponseEvents:
    """Frames the events of one streamed response.

    Args:
        request_id: the id the client sees (its ``id:`` lines).
        builder: the response's output items (ids from ``StableIds`` of the stream).
    """

    def __init__(self, request_id: str, builder: OutputBuilder) -> None:
        self.request_id = request_id
        self.builder = builder
        self.writer = EventWriter()
        #: Output tokens of the deltas framed so far (the offset of the next ``id:`` line).
        self.offset = 0
        #: Closing events the client has (a resume at ``<offset>.<k>``: k), not sent again.
        self.seen = 0

    def group(self, events: Iterable[dict[str, Any]]) -> bytes:
        """The frames of ``events``, numbered on and each with the ``id:`` of :attr:`offset`
        (b"" for none): sent as one write."""
        return b"".join(with_id(self.writer.frame(event), self.request_id, self.offset) for event in events)

    def start(self, response: dict[str, Any]) -> bytes:
        """``response.created`` and ``response.in_progress`` of ``response`` (in progress)."""
        return self.group([{"type": "response.created", "response": response},
                           {"type": "response.in_progress", "response": response}])

    def delta(self, text: str, tokens: int) -> bytes:
        """The frames of one delta of ``tokens`` output tokens (b"" when it completes nothing
        yet: its id would be no boundary the client saw)."""
        self.offset += tokens
        return self.group(self.builder.feed(text, tokens))

    def end(self, events: Iterable[dict[str, Any]]) -> bytes:
        """The frames of the closing ``events`` (after the last delta), numbered on, the
        ``k``-th with the ``id:`` ``<offset>.<k>``, those the client has left out
        (:attr:`seen`): sent as one write."""
        frames = [self.writer.frame(event) for event in events]
        return closing_frames(frames, self.request_id, self.offset, self.seen)

    def restore(self, response: dict[str, Any], pieces: Iterable[tuple[str, int]], seen: int = 0) -> None:
        """Rebuild the stream its client has: the start and the deltas ``pieces`` (``(text,
        tokens)``, ``ResumePoint.pieces``), nothing sent; the next frames follow them, less
        the first ``seen`` closing events (``ResumePoint.after``)."""
        self.start(response)
        for text, tokens in pieces:
            self.delta(text, tokens)
        self.seen = seen
