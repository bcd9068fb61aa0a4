"""Resumable typed event streams (the Responses and Messages APIs): ids and rebuilt state.

Plain chat chunks are independent of one another, so a resume sends the chunks after the
client's offset and nothing else; with ``tools`` or a reasoning parser its chunk builder has
state, rebuilt from the deltas the client has (``ResumePoint.deltas``, ``sse_stream``'s
``had`` in gateway/rest/delivery.py), its call ids from :class:`StableIds`. The Responses API's events (``sequence_number``,
``output_index``, item ids) and Anthropic's (content block ``index``) depend on everything
streamed before them. A resuming gateway therefore rebuilds that state: it feeds the pieces
of text the client has (``ResumePoint.pieces``, journaled in gateway/stream_journal.py) to
a fresh event builder, discards what it built, and goes on from there with the journal's or
the worker's next pieces. For the rebuilt state to be the client's, every id in the events
must come from the stream itself, not from chance: :class:`StableIds`.

Every frame gets an ``id:`` line, ``<request id>/<output tokens so far>`` (:func:`with_id`);
the frames of one delta are sent as one write, so a client has either all of them or, with
the connection broken in that write, the ones before the break, and its ``Last-Event-ID``
then names the delta before (or, for a delta whose first frame arrived, this one: the same
exposure as chat's multi-chunk deltas).

The closing events after the last delta (``response.output_text.done`` ..
``response.completed``; ``content_block_stop`` .. ``message_stop``) each get an id of their
own, ``<request id>/<offset>.<k>``: the ``k``-th event after the output's last ``offset``
(:func:`closing_frames`). A resume at one (``ResumePoint.after``) rebuilds the closing events
and sends those after the ``k``-th, so a client that got some of them gets each of the
others once.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

from gateway.stream_journal import event_id


def with_id(frame: bytes, request_id: str, offset: int, after: int = 0) -> bytes:
    """``frame`` (one SSE event, ``event:``/``data:`` lines and the blank line) with the
    ``id: <request id>/<offset>`` line first (``<offset>.<after>`` for ``after`` > 0: a
    closing event; gateway/stream_journal.py, ``event_id``)."""
    return f"id: {event_id(request_id, offset, after)}\n".encode() + frame


def closing_frames(frames: list[bytes], request_id: str, offset: int, seen: int) -> bytes:
    """The closing ``frames`` (all of them built, so numbering and state match the client's)
    as one write, the ``k``-th (from 1) with the id ``<request id>/<offset>.<k>``, the first
    ``seen`` (``ResumePoint.after``: the client has them) left out."""
    return b"".join(with_id(frame, request_id, offset, k) for k, frame in enumerate(frames, 1) if k > seen)


class StableIds:
    """Object ids (``<prefix>_`` + 48 hex digits) derived from one stream's internal id, the
    n-th of each prefix the same on every gateway that builds the stream's events; the
    internal id is a random ``req-…`` per request, so the ids are unique and unguessable.

    Args:
        seed: the stream's internal request id.
    """

    def __init__(self, seed: str) -> None:
        self._seed = seed
        self._counts: dict[str, int] = defaultdict(int)

    def __call__(self, prefix: str) -> str:
        """The next id of ``prefix`` (``msg``, ``rs``, ``fc``, ``resp``, ``call``)."""
        n = self._counts[prefix]
        self._counts[prefix] += 1
        return f"{prefix}_{hashlib.sha256(f'{self._seed}/{prefix}/{n}'.encode()).hexdigest()[:48]}"
