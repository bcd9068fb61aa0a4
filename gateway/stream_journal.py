"""Streams that survive their gateway: the journal each streamed request keeps in Redis.

Every SSE chunk of a streamed completion carries an ``id:`` line ``<request id>/<offset>``
(:func:`event_id`), the offset being the number of output tokens the client has after that
chunk (the chunks and events after a stream's last delta: ``<request id>/<offset>.<k>``,
gateway/rest/delivery.py, gateway/rest/stream_rebuild.py). A client whose connection broke (its gateway was killed, a proxy dropped it) sends the
same request again to any gateway with ``Last-Event-ID`` set to the last id it got (the SSE
reconnect of the WHATWG HTML spec, "server-sent events"); the gRPC front has
``Resume(request_id, offset)``. The resuming gateway streams only what comes after ``offset``,
so the joined text is that of an unbroken run.

The journal (:class:`StreamJournal`) is what makes that possible from any gateway: at submit
the owning gateway writes a record ``inflight:resume:{internal id}`` (the queued request as
first queued, the key that sent it, the chunk ``created`` time), and before each chunk goes
to the client it appends the delta (token ids and text) to the Redis Stream
``inflight:resume:{id}:events`` (an entry ``d``: a ``Delta``). Appending *before* sending is
what makes a resume exact: the journal always holds at least the tokens the client has. Each
choice's ``Finished`` (reason and usage) is appended too (an entry ``f``) and kept in the
record (``finish:{index}``) before its finish chunk is sent, so a stream that finished is
never generated again: a resume of it replays what the journal holds after the client's
offset (at its end: only the finish chunk(s), the usage and ``[DONE]``) and queues nothing.
A stream whose client sent its own id (REST ``X-Request-Id``) keeps a unique internal id;
``inflight:resume:alias:{key id}:{client id}`` names it for the resume (the latest stream of
that key with that id). All keys expire ``ttl_s`` seconds after the last append.

**The owner lease.** The gateway streaming a request holds ``inflight:resume:{id}:owner``
(a token of its own, ``<reply_to>#<random>``) for ``lease_s`` seconds, refreshed at each
append and by the gateway's :class:`~gateway.stream_lease.LeaseKeeper` while the stream is
open (a slow prefill, a long queue wait); it is deleted when the stream ends in any way.
Every append is fenced (one Lua script: the lease is ours, or free and nobody took it since
we held it, i.e. the record's ``epoch`` is still ours; then append and refresh): a gateway
that lost its lease (stopped past ``lease_s`` while another took the stream over) gets
:class:`LeaseLost` instead of appending, and stops the stream and cancels its run. A Redis
failure breaks a stream's journal (:class:`StreamJournal`): its chunks go on without Redis,
the lease keeper marks the record ``broken`` once Redis answers and keeps the lease, and a
resume relays up to the gap and is then refused.

**A resume** (:meth:`StreamJournal.load`) reads the lease, the record and the events in one
transaction and changes nothing. A finished stream is replayed. Any other is *relayed*
(gateway/stream_relay.py): the resuming gateway serves the journal after the client's offset
and, while the owner's lease lives, follows the owner's appends until the finish, queueing
nothing. Once it delivered all the journal holds and no lease is held (the owner died, or
ended its run without finishing), one gateway takes the stream over atomically
(:meth:`StreamJournal.take_over`: the lease is set only where none is and the journal has
nothing past the taker's cursor, the ``epoch`` bumped, so exactly one of two racing
gateways wins and the other relays from it) and queues a continuation (prompt + every token
journaled) with its own ``reply_to``. The journal is never cut: a resume at any of its chunk
boundaries stays exact while another resume continues it.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass, field

import redis
import redis.asyncio

from protos import link_pb2, queue_pb2

log = logging.getLogger(__name__)

#: Key prefix of the records (``{prefix}{internal id}``; the events under ``…:events``, the
#: owner lease ``…:owner``).
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
#: ``<request id>/<offset>[.<k>]``: printable ASCII, the offset 1 to 10 ASCII digits (a
#: uint32), ``k`` 1 to 9999 (no leading zero).
_EVENT_ID = re.compile(r"([\x21-\x7e]{1,%d})/([0-9]{1,10})(?:\.([1-9][0-9]{0,3}))?" % MAX_EVENT_REQUEST_ID_CHARS)


def alias_key(key_id: str, client_id: str) -> str:
    """The Redis key naming the internal id of ``key_id``'s latest stream with ``client_id``."""
    return f"{ALIAS_PREFIX}{key_id}:{client_id}"


def event_id(request_id: str, offset: int, after: int = 0) -> str:
    """The SSE ``id`` of a chunk: the client-visible request id and the output tokens the
    client has after it (``req-ab12/17``); ``after`` > 0 for the ``after``-th event that
    follows the last delta at that offset (a chat or completions stream's finish and usage
    chunks, gateway/rest/delivery.py; the closing events of the Responses and Messages
    streams, gateway/rest/stream_rebuild.py: ``req-ab12/17.2``)."""
    return f"{request_id}/{offset}.{after}" if after else f"{request_id}/{offset}"


def parse_event_id(value: str) -> tuple[str, int, int] | None:
    """``(request id, offset, after)`` of a ``Last-Event-ID`` value (``after`` 0 for a plain
    ``<request id>/<offset>``), or None when malformed: not ``<request id>/<offset>`` or
    ``<request id>/<offset>.<k>``, a request id longer than :data:`MAX_EVENT_REQUEST_ID_CHARS`
    or not printable ASCII, an offset that is not 1 to 10 ASCII digits (``int`` accepts other
    Unicode digits, ``str.isdigit`` superscripts that ``int`` refuses), a ``k`` that is not
    1 to 9999 (no leading zero)."""
    found = _EVENT_ID.fullmatch(value.strip())
    if found is None:
        return None
    return found.group(1), int(found.group(2)), int(found.group(3) or 0)


#: Entries of the events stream: a ``Delta``'s field, a ``Finished``'s field.
DELTA_FIELD, FINISH_FIELD = b"d", b"f"
#: The lease refresh that also marks the record ``broken`` (its journal has a gap).
_MARK_BROKEN = b"b"
#: The most journal entries one read takes from Redis (a relay holds at most this many).
READ_PAGE = 64

# KEYS: owner, record, events[, alias]. ARGV: token, epoch, lease ms, ttl s, field ('' = only
# refresh, 'b' = refresh and mark the journal broken), payload, finish field. 1: appended (lease
# held or retaken), 0: the lease is lost, 2: the record is gone with no owner (Redis lost its
# data, or the TTL passed): nobody took the stream over, but its journal cannot be continued.
_APPEND = """
local owner = redis.call('GET', KEYS[1])
if owner ~= ARGV[1] then
  if owner then return 0 end
  local epoch = redis.call('HGET', KEYS[2], 'epoch')
  if not epoch then return 2 end
  if epoch ~= ARGV[2] then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
if ARGV[5] == 'b' then
  redis.call('HSET', KEYS[2], 'broken', '1')
elseif ARGV[5] ~= '' then
  redis.call('XADD', KEYS[3], '*', ARGV[5], ARGV[6])
  if ARGV[5] == 'f' then redis.call('HSET', KEYS[2], ARGV[7], ARGV[6]) end
end
for i = 2, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""
# KEYS: owner, record, events. ARGV: token, lease ms, ttl s, cursor, n.
# {'taken', epoch, resumes} | {'owned'} | {'gone'} | {'broken'} | {'finished'} | {'behind'}
_TAKE_OVER = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'owned'} end
if redis.call('EXISTS', KEYS[2]) == 0 then return {'gone'} end
if redis.call('HEXISTS', KEYS[2], 'broken') == 1 then return {'broken'} end
for i = 0, tonumber(ARGV[5]) - 1 do
  if redis.call('HEXISTS', KEYS[2], 'finish:' .. i) == 1 then return {'finished'} end
end
for _, e in ipairs(redis.call('XRANGE', KEYS[3], ARGV[4], '+', 'COUNT', 2)) do
  if e[1] ~= ARGV[4] then return {'behind'} end
end
local epoch = redis.call('HINCRBY', KEYS[2], 'epoch', 1)
local resumes = redis.call('HINCRBY', KEYS[2], 'resumes', 1)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return {'taken', epoch, resumes}
"""
# KEYS: owner. ARGV: token. Deletes the lease only when it is ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class ResumePoint:
    """What a resuming gateway continues from.

    Attributes:
        internal_id: the request's id in the queue, request tables and workers.
        original: the queued request as first queued.
        token_ids, text: the output the client has (its first ``offset`` tokens).
        offset: how many output tokens the client has.
        created: the chunks' ``created`` (Unix seconds) of the first gateway.
        request_id: the id the client sees (its ``id:`` lines, ``x-request-id``).
        model: the model name the stream's request gave ("" when not journaled).
        replay: for a stream that finished, what the journal holds after ``offset`` (its
            deltas, then each choice's ``Finished``), answered without generating; empty
            for a stream not finished (relayed).
        relay: True for a stream not finished: the resume relays its journal from
            :attr:`cursor` on (gateway/stream_relay.py), following its owner while the owner's
            lease lives, and queues a continuation only once nobody holds it.
        cursor: the events-stream id of the journal entry that ends at ``offset`` ("0-0":
            none).
        journal: the resuming gateway's handle of the journal (its own lease token, which
            holds the lease once its relay took the stream over).
        pieces: the journaled deltas the client has, in order, as ``(text, tokens)``: what a
            front whose events depend on how the text was cut (the Responses and Messages
            streams, gateway/rest/stream_rebuild.py) feeds again to rebuild its state.
        deltas: the same deltas whole (``link_pb2.Delta``: each with its choice ``index``),
            what chat's chunk builder is fed again to rebuild its parsers' state
            (gateway/rest/delivery.py, ``sse_stream``), ``n`` > 1 too.
        after: how many of the closing events that follow :attr:`offset` the client has
            (a ``Last-Event-ID`` of ``<request id>/<offset>.<k>``: ``k``; 0 otherwise),
            none of them sent again (gateway/rest/stream_rebuild.py).
    """

    internal_id: str
    original: queue_pb2.QueuedRequest
    token_ids: list[int]
    text: str
    offset: int
    created: int
    request_id: str = ""
    model: str = ""
    replay: tuple = field(default_factory=tuple)
    relay: bool = False
    cursor: str = "0-0"
    journal: "StreamJournal | None" = field(default=None, compare=False, repr=False)
    pieces: tuple = field(default_factory=tuple, compare=False, repr=False)
    deltas: tuple = field(default_factory=tuple, compare=False, repr=False)
    after: int = 0

    @property
    def finished(self) -> bool:
        """True when the stream finished: the resume replays :attr:`replay`."""
        return bool(self.replay)


class ResumeError(Exception):
    """Why a stream cannot be resumed (``code``: ``not_found``, ``offset``, ``n``)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class LeaseLost(Exception):
    """This gateway no longer owns the stream: another gateway took it over (our lease had
    expired); nothing was appended."""


@dataclass(frozen=True)
class TakeOver:
    """The outcome of :meth:`StreamJournal.take_over`: ``status`` ``taken`` (this journal now
    holds the lease; ``attempt`` is the continuation's), ``owned`` (a live owner holds it),
    ``gone`` (no record), ``broken`` (its owner's journal has a gap: it cannot be continued),
    ``finished`` (a choice's finish is journaled) or ``behind`` (the
    journal holds entries after the cursor: read them first)."""

    status: str
    attempt: int = 0


class StreamJournal:
    """One streamed request's record in Redis (see the module docstring).

    Args:
        client: the gateway's asyncio Redis client.
        internal_id: the request's internal id.
        ttl_s: seconds the record lives after its last write.
        alias: :func:`alias_key` of a stream whose client id is not its internal id.
        lease_s: seconds the owner lease lives without a refresh.
        owner: this gateway's name in the lease token (its ``reply_to``).

    A Redis failure (an error, or no answer within the client's timeout) while journaling is
    logged once and breaks the journal: the stream goes on without Redis in its chunk path
    (no append, no fence check: a hung Redis costs a running stream one bounded wait, never
    one per chunk). Only :meth:`refresh` (the :class:`~gateway.stream_lease.LeaseKeeper`, in
    the background) still writes: fenced like an append, it marks the record ``broken`` once
    Redis answers again and then keeps the lease, so no resume takes over a stream still
    running here; a resume relays the journal up to the gap and is then refused
    (``not_resumable``); a lease found lost (a resume took the stream over while Redis was
    away and the lease had lapsed) still ends this run (:class:`LeaseLost`).
    """

    def __init__(self, client: redis.asyncio.Redis, internal_id: str, ttl_s: int,
                 alias: str | None = None, lease_s: float = 5.0, owner: str = ""):
        self._redis = client
        self.key = RECORD_PREFIX + internal_id
        self.events_key = self.key + ":events"
        self.owner_key = self.key + ":owner"
        self._internal_id = internal_id
        #: :func:`alias_key` of a stream whose client id is not its internal id (None: none).
        self.alias = alias
        self._ttl_s = max(1, int(ttl_s))
        self._lease_ms = max(1, int(lease_s * 1000))
        #: The lease's value while this journal holds it (unique per handle).
        self.token = f"{owner}#{secrets.token_hex(8)}"
        #: The record's ``epoch`` when this journal last took the lease (None: never held).
        self.epoch: int | None = None
        #: True once another gateway took the stream over from this journal.
        self.lost = False
        self._broken = False
        #: True once the record carries the ``broken`` mark (written by :meth:`refresh`).
        self._marked = False

    async def open(self, message: queue_pb2.QueuedRequest, key_id: str, created: int,
                   model: str = "") -> None:
        """Write the record of a request just queued (``message`` as first queued, ``model``
        the name its request gave) and take its lease, dropping what an earlier stream of the
        same id left (an earlier owner's later appends are then refused: the epoch moved)."""
        if self._broken:
            return
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.events_key)
                pipe.hdel(self.key, "broken", *(f"finish:{i}" for i in range(max(1, message.sampling.n))))
                pipe.hset(self.key, mapping={"msg": message.SerializeToString(), "key_id": key_id,
                                             "created": str(created), "model": model})
                pipe.hincrby(self.key, "epoch", 1)
                pipe.set(self.owner_key, self.token, px=self._lease_ms)
                pipe.expire(self.key, self._ttl_s)
                if self.alias is not None:
                    pipe.set(self.alias, self._internal_id, ex=self._ttl_s)
                results = await pipe.execute()
            self.epoch = int(results[3])
        except (redis.RedisError, OSError) as exc:
            self._broken = True
            log.warning("stream journal %s: %s; this stream cannot be resumed", self.key, exc)

    async def append(self, delta: link_pb2.Delta) -> None:
        """Journal one delta; awaited before the client gets its chunk.

        Raises:
            LeaseLost: another gateway took the stream over; nothing was appended.
        """
        await self._write(DELTA_FIELD, delta.SerializeToString())

    async def finish(self, finished: link_pb2.Finished) -> None:
        """Record that choice ``finished.index`` ended (reason, usage); awaited before the
        client gets its finish chunk.

        Raises:
            LeaseLost: another gateway took the stream over; nothing was recorded.
        """
        await self._write(FINISH_FIELD, finished.SerializeToString(), f"finish:{finished.index}")

    async def refresh(self) -> bool:
        """Extend the lease by ``lease_s`` (and the record's TTL), first marking a broken
        journal's record ``broken``; False when it is lost (another gateway took the stream
        over). A Redis failure counts as held."""
        try:
            await self._write(b"", b"")
        except LeaseLost:
            return False
        return True

    async def release(self) -> None:
        """Give the lease up (the stream ended here: finished, cancelled, failed), so a
        resume takes the stream over at once instead of after ``lease_s``; a lease another
        gateway holds is left alone. Redis failures are logged: the lease then expires. A
        broken journal's record is marked ``broken`` first (if :meth:`refresh` has not yet),
        so no resume continues it past its gap."""
        if self.epoch is None:
            return
        if self._broken and not self._marked:
            try:
                await self._refresh_broken()
            except LeaseLost:
                return
            if not self._marked:  # Redis still away: the lease lapses, the record stays unmarked
                return
        self.epoch = None
        try:
            await self._redis.register_script(_RELEASE)(keys=[self.owner_key], args=[self.token])
        except (redis.RedisError, OSError) as exc:
            log.warning("stream journal %s: releasing the lease: %s (it expires by itself)", self.key, exc)

    @property
    def held(self) -> bool:
        """True while this journal holds (or held and may retake) the stream's lease."""
        return self.epoch is not None and not self._broken

    @property
    def _append_keys(self) -> list[str]:
        """The append script's KEYS: owner, record, events[, alias]."""
        return [self.owner_key, self.key, self.events_key] + ([self.alias] if self.alias is not None else [])

    @property
    def broken(self) -> bool:
        """True once a Redis failure left a gap in the journal (nothing more is appended)."""
        return self._broken

    async def _write(self, kind: bytes, payload: bytes, finish_field: str = "") -> None:
        if self.lost:
            raise LeaseLost(f"stream {self._internal_id}: another gateway took it over")
        if self.epoch is None:
            return
        if self._broken:
            if kind:  # a delta or finish after the gap: not journaled, Redis not touched
                return
            await self._refresh_broken()
            return
        try:
            done = await self._redis.register_script(_APPEND)(
                keys=self._append_keys, args=[self.token, str(self.epoch), self._lease_ms, self._ttl_s, kind, payload,
                                 finish_field])
        except (redis.RedisError, OSError) as exc:
            if not self._broken:  # an append and the keeper's refresh may both fail: log once
                self._broken = True  # the journal is now incomplete: a later resume is refused
                log.warning("stream journal %s: %s; this stream cannot be resumed past here", self.key, exc)
            return
        self._check_written(int(done))

    def _check_written(self, done: int) -> None:
        """The append script's answer: 1 written; 2 the record vanished with nobody holding
        the lease (Redis restarted empty, or its TTL passed): the stream goes on here, its
        journal broken for good (a resume finds no record and is refused), nothing more
        written; 0 the lease is lost.

        Raises:
            LeaseLost: another gateway took the stream over.
        """
        if done == 2:
            if not self._broken:
                log.warning("stream journal %s: its record is gone (Redis lost its data?); this stream "
                            "cannot be resumed", self.key)
            self._broken = self._marked = True  # nothing left to mark: the record is gone
            return
        if not done:
            self.epoch, self.lost = None, True
            raise LeaseLost(f"stream {self._internal_id}: another gateway took it over")

    async def _refresh_broken(self) -> None:
        """The lease refresh of a broken journal (never in a chunk's path): mark the record
        ``broken`` until that is done, then only refresh; Redis failures are swallowed.

        Raises:
            LeaseLost: the lease is lost (another gateway took the stream over).
        """
        kind = b"" if self._marked else _MARK_BROKEN
        try:
            done = await self._redis.register_script(_APPEND)(
                keys=self._append_keys, args=[self.token, str(self.epoch), self._lease_ms, self._ttl_s, kind, b"", ""])
        except (redis.RedisError, OSError):
            return  # still unreachable: logged when the journal broke
        self._check_written(int(done))
        if not self._marked:
            self._marked = True
            log.info("stream journal %s: Redis answers again; the journal is marked broken", self.key)

    async def take_over(self, cursor: str, n: int) -> TakeOver:
        """Take the stream's lease where none is held, atomically (of two gateways racing,
        one gets ``taken``), once ``cursor`` is the journal's last entry (else ``behind``: the
        relay delivers the rest first). On ``taken`` the record's ``epoch`` and ``resumes`` are bumped
        and :attr:`epoch` set; the continuation's attempt is ``resumes`` times
        :data:`RESUME_ATTEMPT_STRIDE`.

        Raises:
            redis.RedisError, OSError: Redis failed.
        """
        got = await self._redis.register_script(_TAKE_OVER)(
            keys=[self.owner_key, self.key, self.events_key],
            args=[self.token, self._lease_ms, self._ttl_s, cursor, max(1, n)])
        status = got[0].decode() if isinstance(got[0], bytes) else str(got[0])
        if status != "taken":
            return TakeOver(status)
        self.epoch = int(got[1])
        return TakeOver(status, int(got[2]) * RESUME_ATTEMPT_STRIDE)

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
                   ttl_s: int, lease_s: float = 5.0, owner: str = "") -> tuple["StreamJournal", ResumePoint]:
        """Where the stream ``internal_id`` resumes after ``offset`` tokens, for ``key_id``;
        nothing in Redis is changed.

        A stream that finished: the point's ``replay`` holds the deltas after ``offset`` and
        every choice's ``Finished``. Any other: a ``relay`` point from ``cursor``
        (gateway/stream_relay.py), whose journal takes the stream over once it delivered all
        of it and nobody holds the lease. A resume never cuts the journal: what it holds past
        the client's offset was generated for this stream and is served from it (a journal
        only grows, so a racing resume's offset stays a boundary of it).

        Raises:
            ResumeError: no record (never streamed, expired, another key's), ``offset`` not
                at a chunk boundary of the journal, or (a stream nobody streams any more,
                not finished) all its ``max_tokens`` journaled or ``n`` > 1.
            redis.RedisError, OSError: Redis failed.
        """
        journal = cls(client, internal_id, ttl_s, lease_s=lease_s, owner=owner)
        point, owned, n, journaled = await journal._inspect(key_id, offset)
        if not point.finished and not owned:
            if n > 1:
                raise ResumeError("a stream with n > 1 choices cannot be resumed part way", "n")
            if journaled >= point.original.sampling.max_tokens:
                raise ResumeError(f"the stream had delivered all its {point.original.sampling.max_tokens} "
                                  "tokens; only its finish was lost", "offset")
        return journal, point

    async def _inspect(self, key_id: str, offset: int) -> tuple[ResumePoint, bool, int, int]:
        """``(point, owner lease held, n, tokens journaled)`` from one consistent read of the
        lease, the record and the events (``replay`` filled when finished, else a ``relay``)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(self.owner_key)
            pipe.hgetall(self.key)
            pipe.xrange(self.events_key, "-", "+")
            owned, record, entries = await pipe.execute()
        if not record or record.get(b"key_id", b"").decode() != key_id:
            raise ResumeError("no resumable stream with that id (finished long ago, never streamed, "
                              "or sent with another key)", "not_found")
        original = queue_pb2.QueuedRequest.FromString(record[b"msg"])
        n = max(1, original.sampling.n)
        finishes = [record.get(f"finish:{i}".encode()) for i in range(n)]
        finished = all(f is not None for f in finishes)
        tokens: list[int] = []
        text: list[str] = []
        pieces: list[tuple[str, int]] = []
        had: list = []
        rest: list = []
        cursor = "0-0"
        journaled = 0
        for entry_id, fields in entries:
            raw = fields.get(DELTA_FIELD)
            if raw is None:
                continue  # a Finished: the record has them all
            if len(tokens) >= offset:
                delta = link_pb2.Delta.FromString(raw)
                journaled += len(delta.token_ids)
                if finished:
                    rest.append(delta)
                continue
            delta = link_pb2.Delta.FromString(raw)
            tokens.extend(delta.token_ids)
            text.append(delta.text)
            pieces.append((delta.text, len(delta.token_ids)))
            had.append(delta)
            cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        if len(tokens) != offset:
            raise ResumeError(f"offset {offset} is not a chunk boundary of the stream "
                              f"({len(tokens)} tokens journaled)", "offset")
        created = int(record.get(b"created", b"0"))
        model = record.get(b"model", b"").decode()
        replay = (*rest, *(link_pb2.Finished.FromString(f) for f in finishes)) if finished else ()
        point = ResumePoint(self._internal_id, original, tokens, "".join(text), offset, created,
                            model=model, replay=replay, relay=not finished, cursor=cursor, journal=self,
                            pieces=tuple(pieces), deltas=tuple(had))
        return point, bool(owned) and not finished, n, journaled + len(tokens)
