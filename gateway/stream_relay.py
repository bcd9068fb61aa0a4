"""Relaying a stream that another connection still owns (issue 49 item 2).

A client that resumes a stream (``Last-Event-ID``, gRPC ``Resume``) while the stream's owner
lease lives (gateway/stream_journal.py: its gateway still streams it, to a connection it has
not noticed is gone) is not given a second run: its gateway follows the owner's journal
instead. :class:`StreamRelay` yields the journal's entries after the client's offset, then the
owner's appends as they come (``XREAD BLOCK`` on the journal's events stream), until every
choice's ``Finished``. When it has delivered everything journaled and no lease is held any more
(the owner died, or was stopped past its lease), it takes the stream over
(:meth:`StreamJournal.take_over`, atomic: of several relays exactly one wins, the others go on
relaying from the winner) and returns the :class:`~gateway.stream_journal.TakeOver`; its
generation then queues the continuation (prompt + :attr:`StreamRelay.token_ids`).

Reads are pulled by the client: a relay holds at most one page (``READ_PAGE`` entries) and
reads Redis only when its client took what it had, so a relay whose client went away stops
reading.
"""

from __future__ import annotations

from collections import deque

import redis
import redis.asyncio

from gateway.errors import NotFoundError, UnavailableError
from gateway.stream_journal import (DELTA_FIELD, FINISH_FIELD, READ_PAGE, ResumePoint, StreamJournal,
                                    TakeOver)
from protos import link_pb2


def relay_block_ms(lease_s: float, redis_timeout_s: float) -> int:
    """How long one ``XREAD BLOCK`` of a relay waits, in milliseconds: a quarter of the lease
    (so an owner's death is noticed well within it) and of the Redis command timeout (a
    blocked read must answer before the client's socket timeout), at least 10."""
    return max(10, int(min(lease_s, redis_timeout_s) * 250))


class StreamRelay:
    """The journal of ``point``'s stream after the client's offset, followed as it grows.

    Args:
        client: the gateway's asyncio Redis client.
        journal: the resuming gateway's handle of the journal (takes the lease over).
        point: the resume point (a ``relay`` one: its ``cursor``, ``token_ids``, ``text``).
        block_ms: one blocking read's wait (:func:`relay_block_ms`).
    """

    def __init__(self, client: redis.asyncio.Redis, journal: StreamJournal, point: ResumePoint, block_ms: int):
        self._redis = client
        self.journal = journal
        self._cursor = point.cursor
        self._block_ms = block_ms
        self._n = max(1, point.original.sampling.n)
        self._max_tokens = point.original.sampling.max_tokens
        self._buffer: deque = deque()
        #: Every output token id the client has once the last relayed delta is sent.
        self.token_ids: list[int] = list(point.token_ids)
        self._texts: list[str] = [point.text]

    @property
    def text(self) -> str:
        """The output text the client has once the last relayed delta is sent."""
        return "".join(self._texts)

    async def next(self) -> link_pb2.Delta | link_pb2.Finished | TakeOver:
        """The next journaled delta or finish (waiting for the owner's next append), or the
        :class:`TakeOver` (status ``taken``: this gateway now holds the lease) once the owner
        is gone and everything it journaled was returned.

        Raises:
            UnavailableError: Redis failed, or the stream cannot be continued here (``n`` > 1,
                or all its tokens delivered and only its finish lost: ``not_resumable``).
            NotFoundError: the journal expired under the relay.
        """
        try:
            while not self._buffer:
                taken = await self._fill()
                if taken is not None:
                    return taken
        except (redis.RedisError, OSError) as exc:
            raise UnavailableError(f"the stream journal is unreachable ({exc}); resume again") from exc
        entry_id, fields = self._buffer.popleft()
        self._cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        raw = fields.get(DELTA_FIELD)
        if raw is None:
            return link_pb2.Finished.FromString(fields[FINISH_FIELD])
        delta = link_pb2.Delta.FromString(raw)
        self.token_ids.extend(delta.token_ids)
        self._texts.append(delta.text)
        return delta

    async def _fill(self) -> TakeOver | None:
        """Read the next page into the buffer (waiting up to ``block_ms`` for one while the
        owner's lease lives); with nothing left to read and no owner, take over.

        The lease and the page are read in one transaction: an owner journals its last
        entries before it releases its lease, so a page read with no lease seen holds them.
        (Read one after the other, an owner's finish and release landing between the two
        looked like a dead owner with nothing more journaled: ``n`` > 1, or all its tokens
        relayed, then ended the relay with ``not_resumable`` although the finish was there.)"""
        page = {self.journal.events_key: self._cursor}
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(self.journal.owner_key)
            pipe.xread(page, count=READ_PAGE)
            owned, found = await pipe.execute()
        if not found:
            if not owned:
                return await self._take_over()
            found = await self._redis.xread(page, count=READ_PAGE, block=self._block_ms)
        for _stream, entries in found or []:
            self._buffer.extend(entries)
        return None

    async def _take_over(self) -> TakeOver | None:
        """The :class:`TakeOver` when this relay got the lease, else None (read on)."""
        if self._n > 1:
            raise UnavailableError("the stream's gateway is gone and a stream with n > 1 choices cannot be "
                                   "continued part way; retry the request", code="not_resumable")
        if len(self.token_ids) >= self._max_tokens:
            raise UnavailableError("the stream's gateway is gone after all its tokens; only its finish was "
                                   "lost", code="not_resumable")
        taken = await self.journal.take_over(self._cursor, self._n)
        if taken.status == "broken":
            raise UnavailableError("the stream's journal ends here: Redis failed while its gateway streamed "
                                   "it, so it cannot be continued past this point; retry the request",
                                   code="not_resumable")
        if taken.status == "gone":
            raise NotFoundError("the stream's journal expired while it was relayed", param="Last-Event-ID",
                                code="stream_not_found")
        return taken if taken.status == "taken" else None  # owned, behind, finished: read on
