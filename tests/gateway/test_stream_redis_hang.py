"""A Redis that hangs (SIGSTOP) while a stream runs must not stall it (docs/DESIGN.md, the
failure table's "Redis hangs" row): the tokens come over the worker's link, and the stream
journal (gateway/stream_journal.py) may cost the stream one bounded wait (the first append
that times out breaks the journal), never one per chunk. Once Redis answers again the record
is marked ``broken`` and the owner keeps its lease, so a resume relays up to the gap and is
then refused. A private Redis (stopped here), a real gateway, the scripted worker."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import redis

from gateway import keys
from gateway.stream_journal import RECORD_PREFIX
from tests.gateway.conftest import wait_for
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway
from tests.gateway.test_stream_relay import Stream
from tests.helpers.redis_server import start_redis

PIECES = 500  # the scripted worker's "slow" output: 500 tokens whatever max_tokens says
STEP_S = 0.014  # one token per worker step: the stream lasts about 7 s unstopped
SAID = "".join(f"w{i} " for i in range(PIECES))
BODY = {"model": "test-model", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 100,
        "stream": True}
STOP_S = 3.0  # how long Redis is stopped; the gateway's Redis timeout is 0.5 s, its lease 1 s
STOP_AT = 20  # tokens the client has when Redis is stopped


@pytest.fixture()
def stack():
    """``(redis server, gateway, api key)`` on a Redis of this test's own (it gets stopped)."""
    server = start_redis()
    worker = gateway = None
    try:
        worker = FakeWorker(server.url, step_s=STEP_S).start()
        gateway = start_gateway(server.url, redis_timeout_s=0.5, stream_owner_lease_s=1.0)
        client = redis.Redis.from_url(server.url)
        _, key = keys.create_key(client, "tenant-a", "test")
        assert wait_for(lambda: bool(client.keys("inflight:workers:*")), 5)
        client.close()
        yield server, gateway, key
    finally:
        os.kill(server.process.pid, signal.SIGCONT)  # whatever happened in the test
        if gateway is not None:
            gateway.stop()
        if worker is not None:
            worker.stop()
        server.stop()


def _arrivals(stream: Stream, stop) -> list[float]:
    """Read ``stream`` to its end, calling ``stop()`` once the client has STOP_AT tokens;
    the monotonic time each event arrived."""
    times: list[float] = []
    stopped = False
    while True:
        before = len(stream.events)
        stream.read_until(lambda s: len(s.events) > before)
        if len(stream.events) == before:
            return times
        times.append(time.monotonic())
        if not stopped and stream.tokens >= STOP_AT:
            stopped = True
            stop()
        if stream.events[-1].get("data") == "[DONE]":
            return times


def test_a_hung_redis_costs_a_stream_at_most_one_bounded_wait(stack):
    server, gateway, key = stack
    pid = server.process.pid
    timers: list[threading.Timer] = []

    def stop() -> None:  # Redis stopped for STOP_S seconds, the stream read meanwhile
        os.kill(pid, signal.SIGSTOP)
        timers.append(threading.Timer(STOP_S, os.kill, (pid, signal.SIGCONT)))
        timers[0].start()

    stream = Stream(gateway.rest_url, key, body=BODY)
    try:
        assert stream.response.status_code == 200, stream.response.read()
        times = _arrivals(stream, stop)
        assert timers, "the stream ended before Redis was stopped"
        assert not timers[0].is_alive(), "the stream ended while Redis was stopped: make it longer"
    finally:
        for timer in timers:
            timer.cancel()
        os.kill(pid, signal.SIGCONT)
        stream.close()
    assert stream.text == SAID and stream.events[-1]["data"] == "[DONE]"
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"stream {times[-1] - times[0]:.2f} s, longest gap {max(gaps):.2f} s, "
          f"gaps over 0.25 s: {sum(g for g in gaps if g > 0.25):.2f} s, Redis stopped {STOP_S} s")
    # Before the fix each chunk after the first failed append waited the 0.5 s Redis timeout
    # (a fence check per chunk): gaps of 0.5 s adding up to the whole stop. Now one at most.
    assert max(gaps) < STOP_S / 2, max(gaps)
    assert sum(g for g in gaps if g > 0.25) < STOP_S / 2, sorted(gaps)[-10:]


def test_a_broken_journal_is_marked_kept_and_refused_past_its_gap(stack):
    server, gateway, key = stack
    pid = server.process.pid
    client = redis.Redis.from_url(server.url)
    stream = Stream(gateway.rest_url, key, body=BODY)
    try:
        stream.read_until(lambda s: s.tokens >= STOP_AT)
        os.kill(pid, signal.SIGSTOP)
        try:
            stream.read_until(lambda s: s.tokens >= STOP_AT + int(STOP_S / STEP_S / 2))
            time.sleep(max(0.0, STOP_S - 1.0))
        finally:
            os.kill(pid, signal.SIGCONT)
        records = [k for k in client.keys(RECORD_PREFIX + "req-*") if k.count(b":") == 2]
        assert len(records) == 1, records
        record = records[0].decode()
        # Marked broken once Redis answers, and the lease kept while the stream runs here.
        assert wait_for(lambda: client.hget(record, "broken") == b"1", 5)
        assert stream.tokens < PIECES, "the stream ended before the check: make it longer"
        assert client.exists(record + ":owner") == 1
        stream.read_all()
    finally:
        os.kill(pid, signal.SIGCONT)
        stream.close()
    assert stream.text == SAID
    # A resume inside the journal is relayed up to the gap, then refused (never continued).
    resume = Stream(gateway.rest_url, key, last_event_id=stream.events[4]["id"], body=BODY)
    try:
        resume.read_all()
    finally:
        resume.close()
        client.close()
    errors = [json.loads(e["data"]) for e in resume.events if "error" in e.get("data", "")]
    assert errors and errors[-1]["error"]["code"] == "not_resumable", resume.events[-3:]
    assert SAID.startswith(stream.text[:12] + resume.text)
    assert len(resume.text) < len(SAID) - 12
