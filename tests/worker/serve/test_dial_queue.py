"""DialQueue: the entry that waits, off the engine, while its gateway is dialled."""

import asyncio

import pytest

from protos import link_pb2, queue_pb2
from tests.helpers.redis_server import free_port
from worker.serve.consumer import QueueEntry
from worker.serve.dial_queue import DialQueue
from worker.serve.link_client import LinkPool


def _entry(reply_to: str) -> QueueEntry:
    return QueueEntry("s", "1-0", queue_pb2.QueuedRequest(request_id="r", reply_to=reply_to))


def _pool() -> LinkPool:
    return LinkPool(link_pb2.Hello(worker_id="w"), on_cancel=lambda *_: None, on_lost=lambda _: None)


def test_a_refused_dial_hands_the_entry_back_as_failed_and_marks_the_address():
    async def scenario():
        pool, address = _pool(), f"127.0.0.1:{free_port()}"
        dials = DialQueue(pool, timeout_s=5.0)
        entry = _entry(address)
        dials.wait(entry)
        with pytest.raises(RuntimeError):
            dials.wait(_entry(address))  # one at a time: the worker reads nothing meanwhile
        failed = None
        while failed is None:
            assert dials.pending() and dials.ready() is None
            await asyncio.sleep(0.01)
            failed = dials.failed()
        assert failed is entry and not dials.pending() and pool.unreachable_for(address) > 0
        await pool.close()
    asyncio.run(asyncio.wait_for(scenario(), 10))  # refused at once, long before the 5 s timeout


def test_drain_returns_the_waiting_entry_and_stops_the_dial():
    async def scenario():
        pool = _pool()
        dials = DialQueue(pool)
        entry = _entry("10.255.255.1:9")  # not routable here: the dial would hang until its timeout
        dials.wait(entry)
        assert dials.drain() is entry and not dials.pending() and dials.drain() is None
        await pool.close()
    asyncio.run(asyncio.wait_for(scenario(), 10))
