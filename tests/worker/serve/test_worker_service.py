"""WorkerService against a real Redis and a fake gateway link server over real gRPC.

Pins down the queue and link contract of DESIGN.md: pull only when there is
room, XACK only after the gateway's Ack, cancel and link loss free the blocks,
expired entries are dropped at pull.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import defaultdict

import grpc
import pytest
import redis.asyncio as aioredis

from protos import common_pb2, link_pb2, link_pb2_grpc, queue_pb2
from tests.helpers.redis_server import free_port, start_redis
from tests.worker.engine_helpers import make_engine
from tests.worker.fakes import fake_tokenizer
from worker.serve import link_client
from worker.serve import service as service_module
from worker.serve.consumer import GROUP, StreamConsumer, stream_name
from worker.serve.reclaim import Reclaimer, ReclaimSettings
from worker.serve.service import WorkerService
from worker.serve.settings import WorkerSettings

#: The attempt of a stream's first resume (gateway/stream_journal.py, RESUME_ATTEMPT_STRIDE).
RESUME_ATTEMPT = 64
#: The model a worker with default settings serves: its streams are this model's.
MODEL = WorkerSettings().model_id


@pytest.fixture(scope="module")
def private_redis():
    """A Redis of this module's own: the gateway tests' session-wide fake worker
    consumes the shared test Redis and would steal these entries."""
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(private_redis) -> str:
    """URL of the module's Redis, emptied before each test."""
    import redis

    client = redis.Redis.from_url(private_redis.url)
    client.flushall()
    client.close()
    return private_redis.url


class FakeGateway(link_pb2_grpc.LinkServicer):
    """The gateway's side of the link, recording what the worker sends."""

    def __init__(self):
        self.ack_gate = asyncio.Event()
        self.ack_gate.set()
        self.accepted: list[str] = []
        self.text: dict[str, str] = defaultdict(str)
        self.delta_tokens: dict[str, list[int]] = defaultdict(list)  # tokens per delta, in order
        self.finished: dict[str, link_pb2.Finished] = {}
        self.choice_tokens: dict[tuple[str, int], int] = defaultdict(int)  # (request id, choice) -> tokens
        self.finishes: list[link_pb2.Finished] = []  # every Finished, in order
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.links_closed = 0  # worker streams that ended from the worker's side
        self.break_on_accept = False  # end the stream at the next Accepted, without an Ack

    async def Connect(self, request_iterator, context):  # noqa: N802 - gRPC naming
        async def read():
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "accepted":
                    self.accepted.append(message.accepted.request_id)
                    if self.break_on_accept:
                        self.break_on_accept = False
                        self.outbox.put_nowait(None)  # a link blip: this stream ends
                        continue
                    asyncio.create_task(self._ack(message.accepted.request_id))
                elif kind == "step":
                    for delta in message.step.deltas:
                        self.text[delta.request_id] += delta.text
                        self.delta_tokens[delta.request_id].append(len(delta.token_ids))
                        self.choice_tokens[(delta.request_id, delta.index)] += len(delta.token_ids)
                    for fin in message.step.finished:
                        self.finished[fin.request_id] = fin
                        self.finishes.append(fin)
            self.links_closed += 1

        reader = asyncio.create_task(read())
        try:
            while True:
                message = await self.outbox.get()
                if message is None:
                    return
                yield message
        finally:
            reader.cancel()

    async def _ack(self, request_id: str) -> None:
        await self.ack_gate.wait()
        await self.outbox.put(link_pb2.GatewayMessage(ack=link_pb2.Ack(request_id=request_id)))

    def cancel(self, request_id: str, attempt: int = 0, *, plus_one: bool = True) -> None:
        """A ``Cancel`` as the gateway sends it (``attempt`` and ``attempt_plus_one``); with
        ``plus_one`` False only ``attempt``, as a gateway that predates ``attempt_plus_one``."""
        cancel = link_pb2.Cancel(request_id=request_id, attempt=attempt,
                                 attempt_plus_one=attempt + 1 if plus_one else 0)
        self.outbox.put_nowait(link_pb2.GatewayMessage(cancel=cancel))


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


class Harness:
    """A fake gateway server, a worker service over a fake-runner engine, and a Redis client."""

    def __init__(self, redis_url: str, claim_idle_ms: int = 30_000, stream_interval: int = 1, **engine_config):
        self.redis_url = redis_url
        self.claim_idle_ms = claim_idle_ms
        self.stream_interval = stream_interval
        self.engine_config = engine_config
        self.port = free_port()

    async def __aenter__(self):
        self.gateway = FakeGateway()
        self.server = grpc.aio.server()
        link_pb2_grpc.add_LinkServicer_to_server(self.gateway, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        self.redis = aioredis.Redis.from_url(self.redis_url)
        self.engine = make_engine(num_blocks=64, block_size=4, **self.engine_config)
        settings = WorkerSettings(redis_url=self.redis_url, worker_id="w1", poll_ms=20, health_port=0,
                                  claim_idle_ms=self.claim_idle_ms, max_deliveries=3,
                                  stream_interval=self.stream_interval)
        self.service = WorkerService(settings, self.engine, self.redis, "fake")
        self.task = asyncio.create_task(self.service.run())
        return self

    async def __aexit__(self, *exc):
        self.service.stop()
        await asyncio.wait_for(self.task, 10)
        await self.server.stop(0)
        await self.redis.aclose()
        assert self.engine.stats().num_free_blocks == self.engine.stats().num_total_blocks

    async def enqueue(self, request_id: str, prompt: str = "hello world", max_tokens: int = 8,
                      deadline: float = 0.0, attempt: int = 0, reply_to: str | None = None, n: int = 1) -> None:
        request = queue_pb2.QueuedRequest(
            request_id=request_id, tenant="t", prompt_token_ids=fake_tokenizer().encode(prompt),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n),
            priority=1, deadline_unix_s=deadline, reply_to=reply_to or f"127.0.0.1:{self.port}",
            enqueued_unix_s=time.time(), attempt=attempt)
        await self.redis.xadd(stream_name(1, MODEL), {"req": request.SerializeToString()})

    async def pending(self) -> int:
        return (await self.redis.xpending(stream_name(1, MODEL), GROUP))["pending"]

    async def settle_acks(self, timeout_s: float = 2.0) -> None:
        """Wait (at most ``timeout_s``) until no entry is pending: the XACK follows the
        gateway's Ack asynchronously. The caller asserts the count afterwards."""
        deadline = time.monotonic() + timeout_s
        while await self.pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def _slow_steps(engine, delay_s: float = 0.005) -> None:
    """Make each engine step take at least ``delay_s`` (the fake runner is instant), so a
    test can act while a request is still running."""
    step = engine.step

    def slow_step():
        time.sleep(delay_s)
        return step()
    engine.step = slow_step


def _generated(engine, request_id: str) -> int:
    """Tokens the engine has generated for a running request (0 before it starts)."""
    group = engine._groups.get(request_id)
    return 0 if group is None else group[0].num_output_tokens


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_xack_only_after_the_gateway_acks(redis_url):
    async def scenario():
        async with Harness(redis_url) as h:
            h.gateway.ack_gate.clear()
            await h.enqueue("r1")
            await _until(lambda: "r1" in h.gateway.accepted)
            assert await h.pending() == 1  # read, accepted, not yet acknowledged
            h.gateway.ack_gate.set()
            await _until(lambda: "r1" in h.gateway.finished)
            await h.settle_acks()
            assert await h.pending() == 0
            assert await h.redis.xlen(stream_name(1, MODEL)) == 0
            fin = h.gateway.finished["r1"]
            assert fin.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert fin.usage.completion_tokens == 8 and h.gateway.text["r1"]
    run(scenario())


def test_pulls_only_when_the_engine_has_room(redis_url):
    async def scenario():
        async with Harness(redis_url, max_num_seqs=2) as h:
            for i in range(6):
                await h.enqueue(f"r{i}", max_tokens=40)
            await _until(lambda: len(h.gateway.accepted) >= 2)
            # Two running, at most one read and held for room; the rest wait unread in
            # Redis (acknowledged entries are deleted, so XLEN - pending = unread).
            unread = await h.redis.xlen(stream_name(1, MODEL)) - await h.pending()
            assert unread >= 3
            await _until(lambda: len(h.gateway.finished) == 6, timeout_s=30)
    run(scenario())


@pytest.mark.parametrize("how", ["cancel", "gateway_dies"])
def test_cancel_or_lost_link_aborts_and_frees_blocks(redis_url, how):
    async def scenario():
        async with Harness(redis_url, stream_interval=4) as h:
            await h.enqueue("long", max_tokens=200)
            await _until(lambda: len(h.gateway.text["long"]) > 0)
            if how == "cancel":
                h.gateway.cancel("long")
            else:
                await h.server.stop(0)
            await _until(lambda: not h.engine.has_unfinished())
            stats = h.engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks
            assert h.service._fanout.num_held() == 0 and "long" not in h.gateway.finished
    run(scenario())


def test_stream_interval_sends_the_first_token_alone_then_chunks(redis_url):
    async def scenario(interval: int) -> tuple[list[int], str]:
        async with Harness(redis_url, stream_interval=interval) as h:
            await h.enqueue("r", max_tokens=10)
            await _until(lambda: "r" in h.gateway.finished)
            assert h.gateway.finished["r"].usage.completion_tokens == 10
            return h.gateway.delta_tokens["r"], h.gateway.text["r"]
    one_by_one, text = run(scenario(1))
    assert one_by_one == [1] * 10
    chunked, chunked_text = run(scenario(4))
    assert chunked == [1, 4, 4, 1]  # TTFT unchanged; the rest with the Finished
    assert chunked_text == text


def test_parallel_sampling_streams_each_choice_with_its_index(redis_url):
    async def scenario():
        async with Harness(redis_url, enable_prefix_caching=True, stream_interval=2) as h:
            await h.enqueue("r", max_tokens=5, n=3)
            await _until(lambda: len(h.gateway.finishes) == 3)
            assert sorted(f.index for f in h.gateway.finishes) == [0, 1, 2]
            assert all(f.usage.completion_tokens == 5 for f in h.gateway.finishes)
            assert {k: v for k, v in h.gateway.choice_tokens.items()} == {("r", i): 5 for i in range(3)}
            assert h.service._fanout.route("r") is None  # routed until the last choice ended
    run(scenario())


def test_cancel_drops_the_tokens_held_for_a_chunk(redis_url):
    async def scenario():
        async with Harness(redis_url, stream_interval=1000) as h:
            _slow_steps(h.engine)
            await h.enqueue("long", max_tokens=200)
            await _until(lambda: _generated(h.engine, "long") >= 20)  # more held, none sent
            assert h.gateway.delta_tokens["long"] == [1]
            h.gateway.cancel("long")
            await _until(lambda: not h.engine.has_unfinished())
            await asyncio.sleep(0.1)
            assert h.gateway.delta_tokens["long"] == [1] and "long" not in h.gateway.finished
            assert h.service._fanout.num_held() == 0
    run(scenario())


def test_a_continuation_replaces_the_older_attempt_still_running(redis_url):
    """The gateway queued attempt 1 (it lost the link) before this worker aborted attempt 0:
    attempt 1 runs, and attempt 0's abort output is not taken for attempt 1's finish."""
    async def scenario():
        async with Harness(redis_url, stream_interval=4) as h:
            _slow_steps(h.engine)
            await h.enqueue("r", max_tokens=200)
            await _until(lambda: _generated(h.engine, "r") >= 5)
            await h.enqueue("r", max_tokens=8, attempt=1)
            await _until(lambda: "r" in h.gateway.finished)
            fin = h.gateway.finished["r"]
            assert fin.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert fin.usage.completion_tokens == 8
            assert h.gateway.accepted == ["r", "r"]
            await _until(lambda: not h.engine.has_unfinished())
            assert h.service._fanout.num_held() == 0
    run(scenario())


def test_a_cancel_that_came_after_its_run_binds_that_attempt_only(redis_url, monkeypatch):
    """A cancel for a run that already ended here is remembered for a later delivery of that
    attempt (dropped without a prefill), never for a newer attempt from the same gateway: a
    stream resumed and taken over through that gateway queues attempt 64 under the same id,
    and it used to be dropped (aborted) by the cancel its first run's client left. The
    memory lasts ``EARLY_CANCEL_S``."""
    monkeypatch.setattr(service_module, "EARLY_CANCEL_S", 1.0)

    async def scenario():
        async with Harness(redis_url) as h:
            address = f"127.0.0.1:{h.port}"
            for rid in ("r", "q", "old"):
                await h.enqueue(rid, max_tokens=8)
                await _until(lambda: rid in h.gateway.finished)
                h.gateway.cancel(rid)  # its client left as the run ended: the worker no longer runs it
                await _until(lambda: (rid, address) in h.service._early_cancels)
            await h.enqueue("r", max_tokens=8, attempt=RESUME_ATTEMPT)  # the takeover's continuation
            await _until(lambda: len([f for f in h.gateway.finishes if f.request_id == "r"]) == 2)
            assert h.gateway.finished["r"].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert h.gateway.finished["r"].usage.completion_tokens == 8
            assert h.gateway.accepted.count("r") == 2
            await h.enqueue("q", max_tokens=8)  # a later delivery of the cancelled attempt
            await _until(lambda: len([f for f in h.gateway.finishes if f.request_id == "q"]) == 2)
            assert h.gateway.finished["q"].finish_reason == common_pb2.FINISH_REASON_ABORT
            assert h.gateway.accepted.count("q") == 1
            await asyncio.sleep(1.2)  # past EARLY_CANCEL_S: forgotten
            await h.enqueue("old", max_tokens=8)
            await _until(lambda: len([f for f in h.gateway.finishes if f.request_id == "old"]) == 2)
            assert h.gateway.finished["old"].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert ("old", address) not in h.service._early_cancels
            await h.settle_acks()
            assert await h.pending() == 0
    run(scenario())


@pytest.mark.parametrize("current", ["this attempt", "this attempt, attempt only", "no attempt (old gateway)"])
def test_a_late_cancel_of_an_older_attempt_does_not_abort_the_running_one(redis_url, current):
    """The gateway took its stream over on a resume and this worker runs its continuation
    (attempt 64) when the gateway's late cancel of the first run (attempt 0) arrives: ignored,
    the continuation runs on. A cancel of the running attempt still aborts it, and so does one
    from a gateway that says no attempt (``attempt`` 0, no ``attempt_plus_one``: any attempt)."""
    async def scenario():
        async with Harness(redis_url, stream_interval=4) as h:
            _slow_steps(h.engine)
            await h.enqueue("r", max_tokens=200, attempt=RESUME_ATTEMPT)
            await _until(lambda: _generated(h.engine, "r") >= 5)
            h.gateway.cancel("r", 0)  # stale: for attempt 0
            h.gateway.cancel("r", 1, plus_one=False)  # stale too, from a gateway that sent only attempt
            await asyncio.sleep(0.3)
            before = _generated(h.engine, "r")
            await _until(lambda: _generated(h.engine, "r") >= before + 5)
            assert h.service._fanout.route("r") is not None and "r" not in h.gateway.finished
            if current == "this attempt":
                h.gateway.cancel("r", RESUME_ATTEMPT)
            elif current == "this attempt, attempt only":
                h.gateway.cancel("r", RESUME_ATTEMPT, plus_one=False)
            else:
                h.gateway.cancel("r", 0, plus_one=False)
            await _until(lambda: not h.engine.has_unfinished())
            stats = h.engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks
            assert "r" not in h.gateway.finished and h.service._fanout.route("r") is None
    run(scenario())


def test_a_cancel_of_a_newer_attempt_aborts_the_older_run_and_drops_that_attempt(redis_url):
    """The gateway queued attempt 1 (it lost the link) and cancelled it before this worker
    took it, still running attempt 0: attempt 0 is aborted and attempt 1's delivery dropped."""
    async def scenario():
        async with Harness(redis_url, stream_interval=4) as h:
            _slow_steps(h.engine)
            await h.enqueue("r", max_tokens=200)
            await _until(lambda: _generated(h.engine, "r") >= 5)
            h.gateway.cancel("r", 1)
            await _until(lambda: not h.engine.has_unfinished())
            await h.enqueue("r", max_tokens=8, attempt=1)
            await _until(lambda: "r" in h.gateway.finished)
            assert h.gateway.finished["r"].finish_reason == common_pb2.FINISH_REASON_ABORT
            assert h.gateway.accepted == ["r"]
    run(scenario())


def test_an_entry_whose_accept_got_no_ack_is_released_and_runs_again(redis_url):
    """The link broke between Accepted and Ack (a blip: the gateway is alive). The entry
    is released, not acknowledged, and its next delivery runs over a fresh link."""
    async def scenario():
        async with Harness(redis_url) as h:
            h.gateway.break_on_accept = True
            await h.enqueue("r", max_tokens=8)
            await _until(lambda: "r" in h.gateway.finished, timeout_s=20)
            assert h.gateway.accepted == ["r", "r"]
            assert h.gateway.finished["r"].usage.completion_tokens == 8
            await _until(lambda: not h.engine.has_unfinished())
            await h.settle_acks()
            assert await h.pending() == 0
    run(scenario())


def test_an_attempt_replaced_before_its_ack_is_acknowledged_not_cancelled(redis_url, monkeypatch):
    """Attempt 0 got no Ack before attempt 1 replaced it: when attempt 0's wait fails, its
    entry is acknowledged as superseded, and attempt 1 runs on untouched."""
    monkeypatch.setattr(link_client, "ACK_TIMEOUT_S", 0.5)

    async def scenario():
        async with Harness(redis_url) as h:
            _slow_steps(h.engine, 0.02)
            h.gateway.ack_gate.clear()
            await h.enqueue("r", max_tokens=200)
            await _until(lambda: h.gateway.accepted == ["r"])
            await h.enqueue("r", max_tokens=100, attempt=1)
            await _until(lambda: h.gateway.accepted == ["r", "r"])
            h.gateway.ack_gate.set()
            await _until(lambda: "r" in h.gateway.finished, timeout_s=30)
            assert h.gateway.finished["r"].usage.completion_tokens == 100
            assert h.gateway.accepted == ["r", "r"]
            await h.settle_acks()
            assert await h.pending() == 0
    run(scenario())


def test_expired_entry_dropped_at_pull(redis_url):
    async def scenario():
        async with Harness(redis_url) as h:
            await h.enqueue("late", deadline=time.time() - 1)
            await _until(lambda: "late" in h.gateway.finished)
            fin = h.gateway.finished["late"]
            assert fin.finish_reason == common_pb2.FINISH_REASON_ERROR
            assert fin.error_code == "deadline_exceeded"
            assert "late" not in h.gateway.accepted
            assert await h.pending() == 0
    run(scenario())


def test_request_that_can_never_fit_is_rejected_at_once(redis_url):
    async def scenario():
        async with Harness(redis_url) as h:  # 64 blocks x 4 tokens = 256 tokens of KV
            await h.enqueue("huge", max_tokens=1000)
            await h.enqueue("small", max_tokens=4)
            await _until(lambda: {"huge", "small"} <= set(h.gateway.finished))
            fin = h.gateway.finished["huge"]
            assert fin.finish_reason == common_pb2.FINISH_REASON_ERROR
            assert fin.error_code == "invalid_request" and fin.error
            assert h.gateway.finished["small"].finish_reason == common_pb2.FINISH_REASON_LENGTH
    run(scenario())


async def _read_as_dead_worker(redis_url: str, times: int = 1) -> None:
    """A worker that reads one entry and dies before acknowledging it (``times``
    deliveries in all, as if that many workers had died on it)."""
    client = aioredis.Redis.from_url(redis_url)
    for stream in (stream_name(p, MODEL) for p in (0, 1, 2)):
        try:
            await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except Exception:  # noqa: BLE001 - BUSYGROUP
            pass
    reply = await client.xreadgroup(GROUP, "dead-worker", {stream_name(1, MODEL): ">"}, count=1)
    entry_id = reply[0][1][0][0]
    for _ in range(times - 1):
        await client.xclaim(stream_name(1, MODEL), GROUP, "dead-worker", 0, [entry_id])
    await client.aclose()


async def _orphan_then_restart(h: Harness, request_id: str, deliveries: int) -> None:
    """Stop the service, let a "dead worker" read ``request_id`` (``deliveries`` times)
    without acknowledging it, then start a fresh service on the same engine."""
    h.service.stop()
    await asyncio.wait_for(h.task, 10)
    await h.enqueue(request_id)
    await _read_as_dead_worker(h.redis_url, times=deliveries)
    h.service = WorkerService(h.service.settings, h.engine, h.redis, "fake")
    h.task = asyncio.create_task(h.service.run())


def test_entry_of_a_dead_worker_is_reclaimed_and_served_once(redis_url):
    async def scenario():
        h = Harness(redis_url, claim_idle_ms=300)
        await h.__aenter__()
        try:
            await _orphan_then_restart(h, "orphan", deliveries=1)
            await _until(lambda: "orphan" in h.gateway.finished)
            await asyncio.sleep(0.5)
            assert h.gateway.accepted.count("orphan") == 1
            assert h.gateway.finished["orphan"].finish_reason == common_pb2.FINISH_REASON_LENGTH
        finally:
            await h.__aexit__(None, None, None)
    run(scenario())


def test_entry_delivered_too_often_goes_to_dead_letter(redis_url):
    async def scenario():
        h = Harness(redis_url, claim_idle_ms=300)
        await h.__aenter__()
        try:
            await _orphan_then_restart(h, "poison", deliveries=3)
            await _until(lambda: "poison" in h.gateway.finished)
            fin = h.gateway.finished["poison"]
            assert fin.finish_reason == common_pb2.FINISH_REASON_ERROR and "dead-letter" in fin.error
            assert "poison" not in h.gateway.accepted
            assert await h.redis.xlen("inflight:dead:1") == 1
            assert await h.pending() == 0
        finally:
            await h.__aexit__(None, None, None)
    run(scenario())


def test_drain_grace_running_out_hands_unfinished_requests_back(redis_url):
    """SIGTERM's grace period ran out: no Finished for what still runs, the link is
    closed (the gateway re-queues continuations), the blocks are free."""
    async def scenario():
        async with Harness(redis_url, stream_interval=4) as h:
            for rid in ("a", "b"):
                await h.enqueue(rid, max_tokens=240)
            await _until(lambda: h.gateway.text["a"] and h.gateway.text["b"])
            h.service.stop(grace_s=0.0)
            await asyncio.wait_for(h.task, 10)
            assert not h.gateway.finished and h.service._fanout.num_held() == 0
            await _until(lambda: h.gateway.links_closed == 1)
            assert not h.engine.scheduler.has_unfinished()
    run(scenario())


def test_a_drain_says_so_in_the_log(redis_url, caplog):
    """SIGTERM's drain (``stop``) logs its start, with what still runs and its grace, and its
    end: before, a worker stopping for a rollout wrote nothing, so its log could not tell a
    drain from a hang."""
    async def scenario():
        async with Harness(redis_url, stream_interval=4) as h:
            await h.enqueue("a", max_tokens=240)
            await _until(lambda: h.gateway.text["a"])
            with caplog.at_level(logging.INFO, logger="worker.serve.service"):
                h.service.stop(grace_s=0.0)
                await asyncio.wait_for(h.task, 10)
    run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "worker.serve.service"]
    assert any("draining" in line and "1 running" in line and "0 s" in line for line in lines), lines
    assert any(line.startswith("drained") for line in lines), lines


def test_released_entry_is_claimed_by_another_worker_at_once(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        consumer = StreamConsumer(client, "draining", (1,), model=MODEL)
        await consumer.ensure_groups()
        request = queue_pb2.QueuedRequest(request_id="held", priority=1, prompt_token_ids=[1])
        await client.xadd(stream_name(1, MODEL), {"req": request.SerializeToString()})
        entry = await consumer.read_one(None)
        settings = ReclaimSettings(claim_idle_ms=30_000)
        await Reclaimer(client, consumer, "draining", (1,), settings).release(entry)
        other = Reclaimer(client, StreamConsumer(client, "live", (1,), model=MODEL), "live", (1,), settings)
        claimed = await other.claim()
        assert claimed is not None and claimed.request.request_id == "held" and claimed.deliveries == 2
        await client.aclose()
    run(scenario())


def test_second_delivery_of_a_running_request_is_dropped_quietly(redis_url):
    """An entry whose XACK failed is delivered again while its first copy still runs:
    the copy is acknowledged and dropped, with no error Finished for the live request."""
    async def scenario():
        async with Harness(redis_url) as h:
            await h.enqueue("dup", max_tokens=200)
            await _until(lambda: h.gateway.text["dup"])
            await h.enqueue("dup", max_tokens=200)
            await _until(lambda: "dup" in h.gateway.finished, timeout_s=30)
            assert h.gateway.finished["dup"].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert h.gateway.accepted.count("dup") == 1
            assert await h.pending() == 0
    run(scenario())


def test_entries_of_an_unreachable_gateway_are_dead_lettered_without_a_prefill(redis_url, monkeypatch):
    """A gateway died with requests still queued. The worker dials it before any
    prefill; the dial fails, which marks the address unreachable, and its entries are
    deferred without a prefill until they reach the dead-letter stream after
    ``max_deliveries``. Before, every entry was prefilled on each of its deliveries
    (3 × 6 here). A live gateway's request is served meanwhile."""
    monkeypatch.setattr(link_client, "UNREACHABLE_S", 1.0)
    dead = f"127.0.0.1:{free_port()}"

    async def scenario():
        async with Harness(redis_url, claim_idle_ms=2_000) as h:
            added: list[str] = []
            add_request = h.engine.add_request
            h.engine.add_request = lambda request, **kw: added.append(request.request_id) or add_request(request, **kw)
            for i in range(6):
                await h.enqueue(f"gone{i}", reply_to=dead)
            await h.enqueue("live")
            await _until(lambda: "live" in h.gateway.finished)
            deadline = time.monotonic() + 20
            while await h.redis.xlen("inflight:dead:1") < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await h.redis.xlen("inflight:dead:1") == 6
            await h.settle_acks()
            assert await h.pending() == 0
            assert added == ["live"]
            assert h.service.metrics.deferred._value.get() >= 6
            assert h.gateway.finished["live"].usage.completion_tokens == 8
    run(scenario())


def test_entry_of_a_gateway_that_comes_back_runs_on_a_later_delivery(redis_url, monkeypatch):
    """The gateway could not be dialled when its entry was read (cut off, restarting):
    the entry is deferred, not dropped, and runs once the gateway answers again."""
    monkeypatch.setattr(link_client, "UNREACHABLE_S", 0.5)
    port = free_port()

    async def scenario():
        async with Harness(redis_url, claim_idle_ms=1_000) as h:
            await h.enqueue("back", reply_to=f"127.0.0.1:{port}")
            await _until(lambda: h.service.metrics.deferred._value.get() >= 1)
            gateway, server = FakeGateway(), grpc.aio.server()
            link_pb2_grpc.add_LinkServicer_to_server(gateway, server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            try:
                await _until(lambda: "back" in gateway.finished, timeout_s=20)
                assert gateway.accepted == ["back"]
                assert gateway.finished["back"].usage.completion_tokens == 8
                await h.settle_acks()
                assert await h.pending() == 0
            finally:
                await server.stop(0)
    run(scenario())


def test_a_hung_redis_does_not_stall_the_running_streams(redis_url, private_redis):
    """Redis stops answering (SIGSTOP: connections stay open, replies never come) while
    a request runs. The loop's Redis calls are bounded and then paused with a backoff
    (worker/serve/redis_backoff.py), so the stream keeps going; before, the loop waited on
    XREADGROUP for the client's socket timeout at every step (here: for ever)."""
    async def scenario():
        async with Harness(redis_url) as h:
            _slow_steps(h.engine, 0.02)
            await h.enqueue("long", max_tokens=200)
            await _until(lambda: _generated(h.engine, "long") >= 5)
            await h.settle_acks()
            # The pace is compared with this stream's own pace while Redis answered, not with
            # a fixed figure a loaded machine misses: each step waiting on Redis is 50x slower.
            per_token_s = {}
            for hung in (False, True):
                if hung:
                    os.kill(private_redis.process.pid, signal.SIGSTOP)
                try:
                    start, before = time.monotonic(), _generated(h.engine, "long")
                    await _until(lambda: _generated(h.engine, "long") >= before + 10, timeout_s=30)
                    per_token_s[hung] = (time.monotonic() - start) / 10
                finally:
                    os.kill(private_redis.process.pid, signal.SIGCONT)
            assert per_token_s[True] <= 5 * per_token_s[False] + 0.05, per_token_s
            await _until(lambda: "long" in h.gateway.finished, timeout_s=20)
            assert h.gateway.finished["long"].usage.completion_tokens == 200
            await h.settle_acks()
            assert await h.pending() == 0
    run(scenario())


def test_an_idle_worker_backs_off_while_redis_is_down(caplog):
    """Redis goes away under an idle worker: its polls back off (0.5 s, 1 s, 2 s, ...)
    and the log gets one warning per attempt, not a flood (it was ~3 per second).

    Order and counts, not a count within a wall-clock window: the announced pauses double
    from one warning to the next, and no warning comes before the pause the previous one
    announced (a lower bound, which a loaded machine cannot break)."""
    import re

    server = start_redis()

    def failures():
        return [r for r in caplog.records if "the loop polls Redis again" in r.getMessage()]

    async def scenario():
        async with Harness(server.url):
            await asyncio.sleep(0.3)  # groups created, polling
            server.stop()
            caplog.clear()
            await _until(lambda: any("again in 2.0 s" in r.getMessage() for r in failures()), timeout_s=20)
            got = failures()
            pauses = [float(re.search(r"again in ([0-9.]+) s", r.getMessage()).group(1)) for r in got]
            assert pauses[-1] == 2.0 and all(b == 2 * a for a, b in zip(pauses, pauses[1:])), pauses
            gaps = [b.created - a.created for a, b in zip(got, got[1:])]
            assert all(gap >= pause - 0.05 for gap, pause in zip(gaps, pauses)), list(zip(gaps, pauses))
    try:
        with caplog.at_level(logging.WARNING, logger="worker.serve.service"):
            run(scenario())
    finally:
        server.stop()


def test_the_worker_recreates_its_groups_after_redis_restarts_empty(redis_url, private_redis):
    """Redis goes down long enough for the worker's backoff to grow past XAUTOCLAIM's
    1 s period, then comes back without its data: XAUTOCLAIM answers NOGROUP. That is
    Redis answering, not Redis down: the worker recreates its group and serves what is
    queued next (it backed off on NOGROUP and never read again, found by CI)."""
    async def scenario():
        async with Harness(redis_url) as h:
            await h.enqueue("before")
            await _until(lambda: "before" in h.gateway.finished)
            private_redis.shutdown(save=False)
            await asyncio.sleep(4.0)  # failed polls: pauses of 0.5, 1 and 2 s
            private_redis.restart(wipe=True)
            await h.enqueue("after")
            await _until(lambda: "after" in h.gateway.finished, timeout_s=20)
            assert h.gateway.finished["after"].usage.completion_tokens == 8
    run(scenario())
