"""The owner lease of a stream's journal (gateway/stream_journal.py) against a real Redis:
fenced appends, a lapsed lease taken back only while nobody took the stream over, exactly one
winner among racing takeovers, and the keeper's refresh (gateway/stream_lease.py)."""

from __future__ import annotations

import asyncio

import redis.asyncio

from gateway.stream_journal import RECORD_PREFIX, LeaseLost, ResumeError, StreamJournal
from gateway.stream_lease import LeaseKeeper
from protos import link_pb2, queue_pb2

import pytest

MESSAGE = queue_pb2.QueuedRequest(request_id="req-lease", prompt_token_ids=[1, 2, 3])
MESSAGE.sampling.max_tokens = 10


def _delta(text: str) -> link_pb2.Delta:
    return link_pb2.Delta(request_id="req-lease", text=text, token_ids=[ord(text[0])])


def _run(redis_url: str, body) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            await body(client)
        finally:
            await client.aclose()
    asyncio.run(main())


async def _texts(client, journal: StreamJournal) -> list[str]:
    return [link_pb2.Delta.FromString(f[b"d"]).text for _, f in await client.xrange(journal.events_key) if b"d" in f]


def test_a_stale_owner_is_fenced_out_once_another_took_over(redis_url):
    async def body(client) -> None:
        owner = StreamJournal(client, "req-lease", 60, lease_s=0.2, owner="a")
        await owner.open(MESSAGE, "key-1", 0)
        await owner.append(_delta("a0"))
        await asyncio.sleep(0.4)  # stopped past its lease; nobody took over yet
        await owner.append(_delta("a1"))  # taken back: the epoch is still its own
        cursor = (await client.xrange(owner.events_key))[-1][0].decode()
        await client.delete(owner.owner_key)  # lapsed again
        taker = StreamJournal(client, "req-lease", 60, lease_s=5, owner="b")
        assert (await taker.take_over("0-0", 1)).status == "behind"  # entries past its cursor
        taken = await taker.take_over(cursor, 1)
        assert taken.status == "taken" and taken.attempt > 0
        with pytest.raises(LeaseLost):
            await owner.append(_delta("a2"))
        assert not await owner.refresh()
        await owner.release()  # leaves the taker's lease alone
        assert (await client.get(owner.owner_key)).decode() == taker.token
        await taker.append(_delta("b2"))
        assert await _texts(client, owner) == ["a0", "a1", "b2"]
        await taker.release()
        assert not await client.exists(owner.owner_key)
    _run(redis_url, body)


def test_racing_takeovers_have_one_winner(redis_url):
    async def body(client) -> None:
        owner = StreamJournal(client, "req-lease", 60, owner="a")
        await owner.open(MESSAGE, "key-1", 0)
        await owner.release()
        takers = [StreamJournal(client, "req-lease", 60, owner=f"g{i}") for i in range(8)]
        results = await asyncio.gather(*(t.take_over("0-0", 1) for t in takers))
        assert sorted(r.status for r in results) == ["owned"] * 7 + ["taken"]
        assert (await takers[0].take_over("0-0", 1)).status in ("owned", "taken")
    _run(redis_url, body)


def test_a_finished_stream_is_not_taken_over(redis_url):
    async def body(client) -> None:
        owner = StreamJournal(client, "req-lease", 60, owner="a")
        await owner.open(MESSAGE, "key-1", 0)
        await owner.finish(link_pb2.Finished(request_id="req-lease", index=0))
        await owner.release()
        assert (await StreamJournal(client, "req-lease", 60).take_over("0-0", 1)).status == "finished"
        assert (await StreamJournal(client, "req-other", 60).take_over("0-0", 1)).status == "gone"
    _run(redis_url, body)


def test_the_keeper_holds_a_quiet_stream_and_reports_a_lost_lease(redis_url):
    async def body(client) -> None:
        keeper = LeaseKeeper(0.3)
        owner = StreamJournal(client, "req-lease", 60, lease_s=0.3, owner="a")
        await owner.open(MESSAGE, "key-1", 0)
        lost = asyncio.Event()

        async def on_lost() -> None:
            lost.set()
        keeper.hold(owner, on_lost)
        await asyncio.sleep(1.0)  # three leases long without an append
        assert await client.exists(owner.owner_key)
        await client.delete(owner.owner_key)
        taker = StreamJournal(client, "req-lease", 60, owner="b")
        assert (await taker.take_over("0-0", 1)).status == "taken"
        await asyncio.wait_for(lost.wait(), 10)
        assert len(keeper) == 0
    _run(redis_url, body)


def test_closing_the_keeper_cancels_and_awaits_its_task(redis_url):
    """The gateway's shutdown closes the keeper: its task (asleep between refreshes) is ended,
    not left pending on a loop that closes ("Task was destroyed but it is pending"), and a
    stream held afterwards starts none."""
    async def body(client) -> None:
        keeper = LeaseKeeper(60.0)
        owner = StreamJournal(client, "req-lease", 60, lease_s=60.0, owner="a")
        await owner.open(MESSAGE, "key-1", 0)

        async def on_lost() -> None:
            pass
        keeper.hold(owner, on_lost)
        task = keeper._task
        await asyncio.sleep(0)
        assert task is not None and not task.done()
        await keeper.close()
        assert task.done() and len(keeper) == 0
        keeper.hold(owner, on_lost)
        assert keeper._task is None
        await keeper.close()
    _run(redis_url, body)


def test_a_broken_journal_keeps_redis_out_of_its_chunks_and_is_marked_by_the_refresh(redis_url):
    """After a failed write (a Redis timeout: a Redis that hangs) the journal's appends touch
    Redis no more (a hung Redis would cost every chunk its timeout); its refresh (the lease
    keeper's, in the background) marks the record ``broken`` and keeps the lease, so no
    resume takes the stream over while it runs here, nor continues it once it ended."""
    async def body(client) -> None:
        owner = StreamJournal(client, "req-lease", 60, lease_s=0.3, owner="a")
        await owner.open(MESSAGE, "key-1", 0)
        await owner.append(_delta("a0"))
        owner._broken = True  # as after a failed write
        owner._redis = None  # any Redis command now fails the test
        await owner.append(_delta("a1"))  # not appended, Redis not touched
        await owner.finish(link_pb2.Finished(index=0))
        owner._redis = client
        await asyncio.sleep(0.5)
        assert not await client.exists(owner.owner_key)  # lapsed meanwhile (Redis away)
        assert await owner.refresh()  # retaken (nobody took it) and marked
        assert await client.hget(owner.key, "broken") == b"1"
        taker = StreamJournal(client, "req-lease", 60, owner="b")
        assert (await taker.take_over("0-0", 1)).status == "owned"
        await owner.release()
        assert (await taker.take_over("0-0", 1)).status == "broken"  # never continued
        assert await _texts(client, owner) == ["a0"]
    _run(redis_url, body)


def test_a_broken_journal_still_learns_of_a_takeover_at_its_refresh(redis_url):
    """A stream taken over while Redis was away from its owner (its lease had lapsed, the
    record not yet marked) ends its run there: the refresh finds the lease lost."""
    async def body(client) -> None:
        owner = StreamJournal(client, "req-lease", 60, lease_s=0.3, owner="a")
        await owner.open(MESSAGE, "key-1", 0)
        owner._broken = True  # as after a failed write
        await asyncio.sleep(0.5)
        taker = StreamJournal(client, "req-lease", 60, owner="b")
        assert (await taker.take_over("0-0", 1)).status == "taken"
        assert not await owner.refresh()
        with pytest.raises(LeaseLost):
            await owner.append(_delta("a1"))
        assert await _texts(client, owner) == []
        assert await client.hget(owner.key, "broken") is None
    _run(redis_url, body)


def test_a_new_stream_of_the_same_id_drops_the_broken_mark(redis_url):
    """A record reopened by a later stream of the same internal id (a client's own id) is not
    broken: the mark was the earlier stream's."""
    async def body(client) -> None:
        first = StreamJournal(client, "req-lease", 60, owner="a")
        await first.open(MESSAGE, "key-1", 0)
        first._broken = True  # as after a failed write
        assert await first.refresh() and await client.hget(first.key, "broken") == b"1"
        await first.release()
        second = StreamJournal(client, "req-lease", 60, owner="a")
        await second.open(MESSAGE, "key-1", 0)
        assert await client.hget(second.key, "broken") is None
    _run(redis_url, body)


def test_a_stream_journaled_by_a_gateway_before_the_events_stream_is_refused_not_run(redis_url):
    """docs/OPERATIONS.md, Upgrading: a record an older gateway wrote (its deltas in the list
    ``…:deltas``, no lease) is not resumable through this version: the resume is refused
    (``offset``: 400 ``not_resumable``), so it is neither relayed nor continued."""
    async def body(client) -> None:
        key = RECORD_PREFIX + "req-lease"
        await client.hset(key, mapping={"msg": MESSAGE.SerializeToString(), "key_id": "key-1", "created": "0"})
        await client.rpush(key + ":deltas", _delta("a0").SerializeToString(), _delta("a1").SerializeToString())
        with pytest.raises(ResumeError) as refused:
            await StreamJournal.load(client, "req-lease", "key-1", 2, 60)
        assert refused.value.code == "offset"
    _run(redis_url, body)


def test_a_record_lost_with_redis_breaks_the_journal_and_keeps_the_stream(redis_url):
    """Redis restarted empty (or the record's TTL passed): nobody took the stream over, so
    its appends and refreshes are no LeaseLost (the stream goes on here, as a stream that
    does not need Redis must); the journal is broken for good, nothing is written again
    (no lease key recreated) and a resume finds nothing to continue."""
    async def body(client) -> None:
        owner = StreamJournal(client, "req-lease", 60, lease_s=5, owner="a")
        await owner.open(MESSAGE, "key-1", 0)
        await owner.append(_delta("a0"))
        mine = (owner.owner_key, owner.key, owner.events_key)
        await client.delete(*mine)  # as Redis restarted empty (the fixture's Redis is shared: no FLUSHALL)
        await owner.append(_delta("a1"))  # no LeaseLost
        assert await owner.refresh()
        await owner.append(_delta("a2"))
        await owner.finish(link_pb2.Finished(request_id="req-lease"))
        assert owner.broken and not owner.lost
        assert await client.exists(*mine) == 0  # nothing written after the loss
        with pytest.raises(ResumeError):
            await StreamJournal.load(client, "req-lease", "key-1", 1, 60, owner="b")
        await owner.release()
    _run(redis_url, body)
