"""Request table and link server: queued cancel XDELs, running cancel sends Cancel, lost links fail."""

import asyncio

import grpc
import redis.asyncio

from common.redis_keys import stream_name
from tests.gateway.fake_worker import MODEL
from gateway.errors import UnavailableError
from gateway.link_server import LinkSession, add_link_service
from gateway.queue import RequestQueue
from gateway.request_table import RequestState, RequestTable
from protos import common_pb2, link_pb2, link_pb2_grpc, queue_pb2


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_queued_cancel_xdels_and_late_accept_gets_cancel(redis_url):
    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        queue = RequestQueue(client)
        table = RequestTable(queue.remove)
        pending = table.register("r1")
        pending.ticket = await queue.enqueue(queue_pb2.QueuedRequest(request_id="r1", priority=1, model=MODEL))
        assert await client.xlen(stream_name(1, MODEL)) == 1
        await table.cancel("r1")
        assert await client.xlen(stream_name(1, MODEL)) == 0
        assert not table.accept("r1", LinkSession("peer"))  # → Ack + Cancel
        await client.aclose()
    run(go())


def test_running_cancel_and_link_loss():
    async def go():
        table = RequestTable(remove_queued=None)
        session = LinkSession("peer")
        a, b = table.register("a"), table.register("b")
        assert table.accept("a", session) and table.accept("b", session)
        assert a.state is RequestState.RUNNING
        await table.cancel("a")
        sent = session.outbox.get_nowait()
        assert sent.cancel.request_id == "a" and sent.cancel.attempt == 0
        assert sent.cancel.attempt_plus_one == 1  # attempt 0 said, not "any attempt" (an old gateway's 0)
        c = table.register("c")
        c.attempt = 64  # a stream taken over on a resume: the worker keeps a newer attempt's entry
        assert table.accept("c", session, 64)
        await table.cancel("c")
        sent = session.outbox.get_nowait()
        assert (sent.cancel.attempt, sent.cancel.attempt_plus_one) == (64, 65)
        await table.link_lost(session)
        assert isinstance(b.events.get_nowait(), UnavailableError) and len(table) == 0
    run(go())


def test_link_server_ack_and_drop():
    async def go():
        table = RequestTable(remove_queued=None)
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        add_link_service(server, table)
        await server.start()
        live = table.register("live")
        outbox: asyncio.Queue = asyncio.Queue()
        for msg in (link_pb2.WorkerMessage(hello=link_pb2.Hello(worker_id="w")),
                    link_pb2.WorkerMessage(accepted=link_pb2.Accepted(request_id="live")),
                    link_pb2.WorkerMessage(accepted=link_pb2.Accepted(request_id="ghost"))):
            outbox.put_nowait(msg)

        async def outgoing():
            while True:
                yield await outbox.get()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = link_pb2_grpc.LinkStub(ch).Connect(outgoing())
            got = [await call.read() for _ in range(3)]
            assert [m.WhichOneof("kind") for m in got] == ["ack", "ack", "cancel"]
            assert got[2].cancel.request_id == "ghost"
            call.cancel()
        event = await asyncio.wait_for(live.events.get(), 5)
        assert isinstance(event, UnavailableError)
        await server.stop(0)
    run(go())


def test_output_from_a_link_not_running_the_request_is_ignored():
    """A stale second delivery (its XACK failed) on another worker must not reach the
    client of the copy that runs."""
    async def go():
        table = RequestTable(remove_queued=None)
        owner, stray = LinkSession("owner"), LinkSession("stray")
        pending = table.register("r")
        assert table.accept("r", owner)
        assert not table.deliver(link_pb2.Delta(request_id="r", text="x", token_ids=[1]), stray)
        assert not table.finish(link_pb2.Finished(request_id="r"), stray)
        assert table.deliver(link_pb2.Delta(request_id="r", text="ok", token_ids=[2]), owner)
        assert pending.events.get_nowait().text == "ok" and pending.events.empty()
        assert pending.delivered_token_ids == [2] and table.get("r") is pending
        assert table.finish(link_pb2.Finished(request_id="r"), owner) and table.get("r") is None
    run(go())


def test_every_request_of_a_dropped_link_gets_the_link_loss_policy():
    """A dropped link runs the (awaiting, like an XADD) link-loss policy for each of its
    requests. A fresh-eyes run once saw only the first of four continued after a
    SIGKILL (the handler cancelled mid-policy); the handling now runs detached and
    shielded (gateway/link_server.py), which this test cannot tell apart."""
    async def go():
        handled: list[str] = []

        async def slow_policy(pending):
            await asyncio.sleep(0.05)  # like an XADD
            handled.append(pending.request_id)

        table = RequestTable(remove_queued=None, on_link_lost=slow_policy)
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        add_link_service(server, table)
        await server.start()
        ids = [f"r{i}" for i in range(4)]
        for rid in ids:
            table.register(rid)
        outbox: asyncio.Queue = asyncio.Queue()
        outbox.put_nowait(link_pb2.WorkerMessage(hello=link_pb2.Hello(worker_id="w")))
        for rid in ids:
            outbox.put_nowait(link_pb2.WorkerMessage(accepted=link_pb2.Accepted(request_id=rid)))

        async def outgoing():
            while True:
                yield await outbox.get()
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = link_pb2_grpc.LinkStub(ch).Connect(outgoing())
        assert [(await call.read()).WhichOneof("kind") for _ in ids] == ["ack"] * len(ids)
        call.cancel()  # the worker dies: its stream is reset
        await ch.close()
        for _ in range(100):
            if len(handled) == len(ids):
                break
            await asyncio.sleep(0.05)
        assert sorted(handled) == ids
        await server.stop(0)
    run(go())


def test_a_request_with_n_choices_ends_after_its_last_finished():
    async def go():
        table = RequestTable(remove_queued=None)
        session = LinkSession("w")
        pending = table.register("r", choices=3)
        assert table.accept("r", session)
        stop = common_pb2.FINISH_REASON_STOP
        assert table.deliver(link_pb2.Delta(request_id="r", text="a", token_ids=[1], index=2), session)
        assert table.finish(link_pb2.Finished(request_id="r", finish_reason=stop, index=2), session)
        assert not table.finish(link_pb2.Finished(request_id="r", finish_reason=stop, index=2), session)
        assert table.finish(link_pb2.Finished(request_id="r", finish_reason=stop, index=0), session)
        assert table.get("r") is pending and pending.state is RequestState.RUNNING
        assert table.finish(link_pb2.Finished(request_id="r", finish_reason=stop, index=1), session)
        assert table.get("r") is None and "r" not in session.request_ids
        assert [e.index for e in [pending.events.get_nowait() for _ in range(4)]] == [2, 2, 0, 1]
        assert session.outbox.empty()  # every choice finished: nothing to cancel
    run(go())


def test_an_error_of_one_choice_ends_the_request_and_cancels_the_others():
    async def go():
        table = RequestTable(remove_queued=None)
        session = LinkSession("w")
        pending = table.register("r", choices=2)
        assert table.accept("r", session)
        assert table.finish(link_pb2.Finished(request_id="r", finish_reason=common_pb2.FINISH_REASON_ERROR,
                                              index=1), session)
        assert table.get("r") is None and pending.events.get_nowait().index == 1
        assert session.outbox.get_nowait().cancel.request_id == "r"
        assert not table.finish(link_pb2.Finished(request_id="r", index=0), session)
    run(go())
