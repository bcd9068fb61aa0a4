"""Streams that survive their gateway: the journal each streamed request keeps in Redis.

Every SSE chunk of a streamed completion carries an ``id:`` line ``<request id>/<offset>``
(:func:`event_id`), the offset being the number of output tokens the client has after that
chunk. A client whose connection broke (its gateway was killed, a proxy dropped it) sends the
same request again to any gateway with ``Last-Event-ID`` set to the last id it got (the SSE
reconnect of the WHATWG HTML spec, "server-sent events"); the gRPC front has
``Resume(request_id, offset)``. The gateway then continues the request as a continuation
(gateway/continuation.py: prompt + the tokens the client has) and streams only what comes
after ``offset``, so the joined text is that of an unbroken run.

The journal (:class:`StreamJournal`) is what makes that possible from any gateway: at submit
the owning gateway writes a record ``inflight:resume:{internal id}`` (the queued request as
first queued, the key that sent it, the chunk ``created`` time), and before each chunk goes
to the client it appends the delta (token ids and text) to ``inflight:resume:{id}:deltas``.
Appending *before* sending is what makes a resume exact: the journal always holds at least
the tokens the client has. Each choice's ``Finished`` (reason and usage) is recorded in the
record (``finish:{index}``) before its finish chunk is sent, so a stream that finished is
never generated again: a resume of it replays what the journal holds after the client's
offset (at its end: only the finish chunk(s), the usage and ``[DONE]``) and queues nothing.
A stream whose client sent its own id (REST ``X-Request-Id``) keeps a unique internal id;
``inflight:resume:alias:{key id}:{client id}`` names it for the resume (the latest stream of
that key with that id). All keys expire ``ttl_s`` seconds after the last append.

A resume does not relay from the first gateway while it lives: that gateway cancels the run
when its client disconnects (as for any client that goes away), so the resuming gateway
always continues from the journal (one prefill of prompt + delivered tokens, as for a
worker's death).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import redis
import redis.asyncio

from protos import link_pb2, queue_pb2

log = logging.getLogger(__name__)

#: Key prefix of the records (``{prefix}{internal id}``; the deltas under ``…:deltas``).
RECORD_PREFIX = "inflight:resume:"
#: A resuming gateway's attempts start at ``resumes * RESUME_ATTEMPT_STRIDE`` (a Redis
#: counter in the record), above any attempt the gateways before it reached by their own
#: continuations (at most ``max_continuations``, which must stay below the stride), so a
#: worker never drops the resumed entry as a stale second delivery.
RESUME_ATTEMPT_STRIDE = 64
#: Key prefix of the client-id aliases (``{prefix}{key id}:{client id}`` → internal id).
ALIAS_PREFIX = RECORD_PREFIX + "alias:"
#: The longest request id a ``Last-Event-ID`` may name (a client's own id is at most 128
#: characters: gateway/admission/request_id.py; ours are ``req-`` + 32 hex digits).
MAX_EVENT_REQUEST_ID_CHARS = 128
#: ``<request id>/<offset>``: printable ASCII, the offset 1 to 10 ASCII digits (a uint32).
_EVENT_ID = re.compile(r"([\x21-\x7e]{1,%d})/([0-9]{1,10})" % MAX_EVENT_REQUEST_ID_CHARS)


def alias_key(key_id: str, client_id: str) -> str:
    """The Redis key naming the internal id of ``key_id``'s latest stream with ``client_id``."""
    return f"{ALIAS_PREFIX}{key_id}:{client_id}"


def event_id(request_id: str, offset: int) -> str:
    """The SSE ``id`` of a chunk: the client-visible request id and the output tokens the
    client has after it (``req-ab12/17``)."""
    return f"{request_id}/{offset}"


def parse_event_id(value: str) -> tuple[str, int] | None:
    """``(request id, offset)`` of a ``Last-Event-ID`` value, or None when malformed: not
    ``<request id>/<offset>``, a request id longer than :data:`MAX_EVENT_REQUEST_ID_CHARS` or
    not printable ASCII, an offset that is not 1 to 10 ASCII digits (``int`` accepts other
    Unicode digits, ``str.isdigit`` superscripts that ``int`` refuses)."""
    found = _EVENT_ID.fullmatch(value.strip())
    if found is None:
        return None
    return found.group(1), int(found.group(2))


@dataclass(frozen=True)
class ResumePoint:
    """What a resuming gateway continues from.

    Attributes:
        internal_id: the request's id in the queue, request tables and workers.
        original: the queued request as first queued.
        token_ids, text: the output the client has (its first ``offset`` tokens).
        offset: how many output tokens the client has.
        attempt: the attempt number the continuation is queued under.
        created: the chunks' ``created`` (Unix seconds) of the first gateway.
        request_id: the id the client sees (its ``id:`` lines, ``x-request-id``).
        model: the model name the stream's request gave ("" when not journaled).
        replay: for a stream that finished, what the journal holds after ``offset`` (its
            deltas, then each choice's ``Finished``), answered without generating; empty
            for a stream to continue on a worker.
    """

    internal_id: str
    original: queue_pb2.QueuedRequest
    token_ids: list[int]
    text: str
    offset: int
    attempt: int
    created: int
    request_id: str = ""
    model: str = ""
    replay: tuple = field(default_factory=tuple)

    @property
    def finished(self) -> bool:
        """True when the stream finished: the resume replays :attr:`replay`."""
        return bool(self.replay)


class ResumeError(Exception):
    """Why a stream cannot be resumed (``code``: ``not_found``, ``offset``, ``n``)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class StreamJournal:
    """One streamed request's record in Redis (see the module docstring).

    Args:
        client: the gateway's asyncio Redis client.
        internal_id: the request's internal id.
        ttl_s: seconds the record lives after its last write.

    Redis failures while journaling are logged and swallowed: the stream goes on, only a
    resume past the last journaled token is then refused (:meth:`load` raises).
    """

    def __init__(self, client: redis.asyncio.Redis, internal_id: str, ttl_s: int,
                 alias: str | None = None):
        self._redis = client
        self.key = RECORD_PREFIX + internal_id
        self.deltas_key = self.key + ":deltas"
        self._internal_id = internal_id
        #: :func:`alias_key` of a stream whose client id is not its internal id (None: none).
        self.alias = alias
        self._ttl_s = max(1, int(ttl_s))
        self._broken = False

    async def open(self, message: queue_pb2.QueuedRequest, key_id: str, created: int,
                   model: str = "") -> None:
        """Write the record of a request just queued (``message`` as first queued, ``model``
        the name its request gave), dropping what an earlier stream of the same id left."""
        def add(pipe) -> None:
            pipe.delete(self.deltas_key)
            pipe.hdel(self.key, *(f"finish:{i}" for i in range(max(1, message.sampling.n))))
            pipe.hset(self.key, mapping={"msg": message.SerializeToString(), "key_id": key_id,
                                         "created": str(created), "model": model})
            if self.alias is not None:
                pipe.set(self.alias, self._internal_id)
        await self._write(add)

    async def append(self, delta: link_pb2.Delta) -> None:
        """Journal one delta; awaited before the client gets its chunk."""
        await self._write(lambda pipe: pipe.rpush(self.deltas_key, delta.SerializeToString()))

    async def finish(self, finished: link_pb2.Finished) -> None:
        """Record that choice ``finished.index`` ended (reason, usage); awaited before the
        client gets its finish chunk."""
        await self._write(lambda pipe: pipe.hset(self.key, f"finish:{finished.index}",
                                                 finished.SerializeToString()))

    async def _write(self, add) -> None:
        if self._broken:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                add(pipe)
                pipe.expire(self.key, self._ttl_s)
                pipe.expire(self.deltas_key, self._ttl_s)
                if self.alias is not None:
                    pipe.expire(self.alias, self._ttl_s)
                await pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._broken = True  # the journal is now incomplete: a later resume is refused
            log.warning("stream journal %s: %s; this stream cannot be resumed past here", self.key, exc)

    @classmethod
    async def resolve(cls, client: redis.asyncio.Redis, key_id: str, client_id: str) -> str | None:
        """The internal id of ``key_id``'s latest stream whose client id was ``client_id``
        (:func:`alias_key`), or None.

        Raises:
            redis.RedisError, OSError: Redis failed.
        """
        found = await client.get(alias_key(key_id, client_id))
        return found.decode() if found else None

    @classmethod
    async def load(cls, client: redis.asyncio.Redis, internal_id: str, key_id: str, offset: int,
                   ttl_s: int) -> tuple["StreamJournal", ResumePoint]:
        """The journal of ``internal_id`` cut at ``offset`` tokens, for a resume by ``key_id``.

        A stream still running (no ``Finished`` recorded): the deltas beyond ``offset``
        (journaled, never received) are dropped from the journal, which the resuming gateway
        then goes on appending to. A stream that finished: nothing is changed, and the point's
        ``replay`` holds the deltas after ``offset`` and every choice's ``Finished``.

        Raises:
            ResumeError: no record (never streamed, expired, another key's), ``offset`` not
                at a chunk boundary of the journal, or (a stream still running) at
                ``max_tokens`` or a request with ``n`` > 1.
            redis.RedisError, OSError: Redis failed.
        """
        journal = cls(client, internal_id, ttl_s)
        record = await client.hgetall(journal.key)
        if not record or record.get(b"key_id", b"").decode() != key_id:
            raise ResumeError("no resumable stream with that id (finished long ago, never streamed, "
                              "or sent with another key)", "not_found")
        original = queue_pb2.QueuedRequest.FromString(record[b"msg"])
        n = max(1, original.sampling.n)
        finishes = [record.get(f"finish:{i}".encode()) for i in range(n)]
        finished = all(f is not None for f in finishes)
        if not finished and n > 1:
            raise ResumeError("a stream with n > 1 choices cannot be resumed part way", "n")
        if not finished and offset >= original.sampling.max_tokens:
            raise ResumeError(f"the stream had delivered all its {original.sampling.max_tokens} tokens; "
                              "only its finish was lost", "offset")
        tokens: list[int] = []
        text: list[str] = []
        rest: list = []
        kept = 0
        for raw in await client.lrange(journal.deltas_key, 0, -1):
            if len(tokens) >= offset:
                if not finished:
                    break
                rest.append(link_pb2.Delta.FromString(raw))
                continue
            delta = link_pb2.Delta.FromString(raw)
            tokens.extend(delta.token_ids)
            text.append(delta.text)
            kept += 1
        if len(tokens) != offset:
            raise ResumeError(f"offset {offset} is not a chunk boundary of the stream "
                              f"({len(tokens)} tokens journaled)", "offset")
        created = int(record.get(b"created", b"0"))
        model = record.get(b"model", b"").decode()
        if finished:
            replay = (*rest, *(link_pb2.Finished.FromString(f) for f in finishes))
            return journal, ResumePoint(internal_id, original, tokens, "".join(text), offset, 0, created,
                                        model=model, replay=replay)
        async with client.pipeline(transaction=False) as pipe:
            pipe.ltrim(journal.deltas_key, 0, kept - 1) if kept else pipe.delete(journal.deltas_key)
            pipe.hincrby(journal.key, "resumes", 1)
            pipe.expire(journal.key, journal._ttl_s)
            _, resumes, _ = await pipe.execute()
        point = ResumePoint(internal_id, original, tokens, "".join(text), offset,
                            int(resumes) * RESUME_ATTEMPT_STRIDE, created, model=model)
        return journal, point
