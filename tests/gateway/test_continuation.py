"""Continuations after a worker's link drops (DESIGN.md: "worker dies after XACK").

A private Redis (the session one has a fake worker consuming from it)."""

import asyncio
import time

import pytest
import redis.asyncio

from gateway.continuation import ContinuationPolicy
from gateway.errors import DeadlineExceededError, UnavailableError
from gateway.link_server import LinkSession
from gateway.metrics import GatewayMetrics
from gateway.queue import CONSUMER_GROUP, RequestQueue, stream_name
from gateway.request_table import RequestState, RequestTable
from protos import common_pb2, link_pb2, queue_pb2
from tests.gateway.fake_worker import MODEL
from tests.helpers.redis_server import start_redis

STREAM = stream_name(1, MODEL)


@pytest.fixture(scope="module")
def server():
    s = start_redis()
    yield s
    s.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def _message(rid: str, max_tokens: int = 10, deadline: float | None = None) -> queue_pb2.QueuedRequest:
    return queue_pb2.QueuedRequest(
        request_id=rid, priority=1, prompt_token_ids=[1, 2, 3], reply_to="127.0.0.1:1", model=MODEL,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=5),
        deadline_unix_s=time.time() + 60 if deadline is None else deadline)


async def _setup(url: str, max_attempts: int = 3):
    client = redis.asyncio.Redis.from_url(url)
    await client.flushall()
    await client.xgroup_create(STREAM, CONSUMER_GROUP, id="0", mkstream=True)
    queue = RequestQueue(client)
    metrics = GatewayMetrics()
    policy = ContinuationPolicy(queue, metrics, max_attempts)
    table = RequestTable(queue.remove, on_link_lost=policy)
    policy.request_table = table
    return client, queue, table, metrics


async def _running(table: RequestTable, queue: RequestQueue, message, session, client):
    """Register, enqueue, let a 'worker' read the entry and accept it."""
    pending = table.register(message.request_id)
    pending.message = message
    pending.ticket = await queue.enqueue(message)
    await client.xreadgroup(CONSUMER_GROUP, "w1", {STREAM: ">"}, count=1)
    assert table.accept(message.request_id, session, message.attempt)
    return pending


async def _entries(client) -> list[queue_pb2.QueuedRequest]:
    return [queue_pb2.QueuedRequest.FromString(f[b"req"]) for _, f in await client.xrange(STREAM)]


def test_link_loss_requeues_a_continuation_with_what_was_delivered(server):
    async def go():
        client, queue, table, metrics = await _setup(server.url)
        session = LinkSession("worker-a")
        pending = await _running(table, queue, _message("r1"), session, client)
        table.deliver(link_pb2.Delta(request_id="r1", text="Hel", token_ids=[7, 8]))
        table.deliver(link_pb2.Delta(request_id="r1", text="lo", token_ids=[9]))
        await table.link_lost(session)

        [cont] = await _entries(client)  # the original entry is gone (XDEL)
        assert list(cont.resumed_token_ids) == [7, 8, 9] and cont.resumed_text == "Hello"
        assert cont.attempt == 1 and cont.sampling.seed == 5 and cont.sampling.max_tokens == 10
        assert list(cont.prompt_token_ids) == [1, 2, 3]
        # The gateway's Redis user may not XACK (docs/SECURITY.md): the deleted entry stays
        # pending until a worker's XAUTOCLAIM, which drops it instead of redelivering it.
        assert (await client.xpending(STREAM, CONSUMER_GROUP))["pending"] == 1
        _, claimed, deleted = await client.xautoclaim(STREAM, CONSUMER_GROUP, "w2", 0, "0-0")
        assert claimed == [] and len(deleted) == 1
        assert (await client.xpending(STREAM, CONSUMER_GROUP))["pending"] == 0
        assert pending.state is RequestState.QUEUED and pending.ticket is not None
        # a stale copy of the first attempt is refused; the continuation is accepted
        assert not table.accept("r1", LinkSession("worker-b"), 0)
        assert table.accept("r1", LinkSession("worker-b"), 1)
        # the client saw its two deltas and no error
        events = [pending.events.get_nowait() for _ in range(pending.events.qsize())]
        assert [e.text for e in events] == ["Hel", "lo"]
        assert metrics.continuations.labels(outcome="resumed")._value.get() == 1
        await client.aclose()
    run(go())


def test_attempts_are_bounded(server):
    async def go():
        client, queue, table, metrics = await _setup(server.url, max_attempts=1)
        pending = await _running(table, queue, _message("r2"), LinkSession("a"), client)
        await table.link_lost(pending.session)
        [cont] = await _entries(client)
        await client.xreadgroup(CONSUMER_GROUP, "w2", {STREAM: ">"}, count=1)
        second = LinkSession("b")
        assert table.accept("r2", second, cont.attempt)
        await table.link_lost(second)
        assert isinstance(pending.events.get_nowait(), UnavailableError)
        assert table.get("r2") is None and len(await _entries(client)) == 1
        await client.aclose()
    run(go())


def test_a_request_past_its_deadline_is_not_continued(server):
    async def go():
        client, queue, table, _ = await _setup(server.url)
        pending = await _running(table, queue, _message("r3", deadline=time.time() - 1), LinkSession("a"), client)
        await table.link_lost(pending.session)
        assert isinstance(pending.events.get_nowait(), DeadlineExceededError)
        assert await _entries(client) == [] or all(e.attempt == 0 for e in await _entries(client))
        await client.aclose()
    run(go())


def test_redis_down_fails_the_client_with_unavailable(server):
    async def go():
        client, queue, table, _ = await _setup(server.url)
        pending = await _running(table, queue, _message("r4"), LinkSession("a"), client)
        queue._redis = redis.asyncio.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
        await table.link_lost(pending.session)
        error = pending.events.get_nowait()
        assert isinstance(error, UnavailableError) and "re-queued" in error.message
        assert table.get("r4") is None
        await client.aclose()
    run(go())


def test_a_queued_request_whose_entry_vanished_is_queued_again(server):
    """A Redis restart that lost its data: the gateway still holds the request and
    queues it again after two sweeps that miss its entry."""
    from gateway.queue_watch import QueueWatch

    async def go():
        client, queue, table, metrics = await _setup(server.url)
        pending = table.register("lost")
        pending.message = _message("lost")
        pending.ticket = await queue.enqueue(pending.message)
        kept = table.register("kept")
        kept.message = _message("kept")
        kept.ticket = await queue.enqueue(kept.message)
        watch = QueueWatch(table, queue, table._on_link_lost)
        assert await watch.sweep() == 0
        await client.xdel(STREAM, pending.ticket.entry_id)  # what a lossy restart does
        assert await watch.sweep() == 0  # missing once: maybe a worker's Finished is in flight
        assert await watch.sweep() == 1
        entries = await _entries(client)
        assert sorted((e.request_id, e.attempt) for e in entries) == [("kept", 0), ("lost", 1)]
        assert pending.state is RequestState.QUEUED and pending.attempt == 1
        assert await watch.sweep() == 0 and metrics.continuations.labels(outcome="requeued")._value.get() == 1
        await client.aclose()
    run(go())


def _n_message(rid: str, n: int) -> queue_pb2.QueuedRequest:
    message = _message(rid)
    message.sampling.n = n
    return message


def test_n_choices_before_any_token_are_requeued_whole(server):
    async def go():
        client, queue, table, metrics = await _setup(server.url)
        pending = await _running(table, queue, _n_message("n1", 3), LinkSession("a"), client)
        pending.choices = 3
        await table.link_lost(pending.session)
        [cont] = await _entries(client)
        assert cont.sampling.n == 3 and cont.attempt == 1 and not cont.resumed_token_ids
        assert pending.state is RequestState.QUEUED and pending.events.empty()
        assert metrics.continuations.labels(outcome="resumed")._value.get() == 1
        await client.aclose()
    run(go())


def test_n_choices_after_a_token_fail_with_unavailable(server):
    """The worker refuses a continuation with n > 1 and resumed tokens: the client gets
    a clear UNAVAILABLE instead of choices that restart."""
    async def go():
        client, queue, table, metrics = await _setup(server.url)
        session = LinkSession("a")
        pending = await _running(table, queue, _n_message("n2", 2), session, client)
        pending.choices = 2
        table.deliver(link_pb2.Delta(request_id="n2", text="x", token_ids=[7], index=1), session)
        await table.link_lost(session)
        assert pending.events.get_nowait().index == 1
        error = pending.events.get_nowait()
        assert isinstance(error, UnavailableError) and error.code == "not_resumable"
        assert "n=2" in error.message and "retry" in error.message
        # no continuation queued (the original entry is the worker's to XACK)
        assert table.get("n2") is None and [e.attempt for e in await _entries(client)] == [0]
        assert metrics.continuations.labels(outcome="unavailable")._value.get() == 1
        await client.aclose()
    run(go())


def test_a_stream_taken_over_elsewhere_is_not_continued(server):
    """A gateway that woke after another took its stream over (``pending.owned`` says the
    lease is lost, gateway/stream_journal.py) queues no continuation when its link drops."""
    async def go():
        client, queue, table, metrics = await _setup(server.url)
        session = LinkSession("worker-a")
        pending = await _running(table, queue, _message("r1"), session, client)

        async def lost() -> bool:
            return False
        pending.owned = lost
        table.deliver(link_pb2.Delta(request_id="r1", text="Hel", token_ids=[7, 8]))
        await table.link_lost(session)
        assert [e.attempt for e in await _entries(client)] == [0]  # only the original: no continuation
        events = [pending.events.get_nowait() for _ in range(pending.events.qsize())]
        assert events[-1].code == "stream_taken_over"
        assert table.get("r1") is None
        await client.aclose()
    run(go())
