"""KV-aware routing against a real Redis: two worker services (fake-runner engines that
publish their KV events), the gateway's router and producer (gateway/routing/,
gateway/queue.py), and a fake gateway link over real gRPC.

A request whose prefix one worker holds is queued on that worker's own stream and
served there from its prefix cache; a prompt nobody holds goes to the shared stream;
a dead or drained worker's own stream is taken over by the others, so nothing routed
to it waits; with routing off everything is shared; the queue depth counts own streams.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import redis.asyncio as aioredis

from common.redis_keys import heartbeat_key, kv_blocks_key, kv_load_key, router_workers, stream_name, worker_stream
from gateway.admission.ratelimit import Limiter
from gateway.errors import RateLimitError
from gateway.keys import KeyRecord
from gateway.metrics import GatewayMetrics
from gateway.queue import RequestQueue
from gateway.routing.router import KvRouter
from gateway.routing.scoring import RouterConfig
from protos import common_pb2, link_pb2_grpc, queue_pb2
from tests.helpers.redis_server import free_port, start_redis
from tests.worker.engine_helpers import make_engine
from tests.worker.fakes import fake_tokenizer
from tests.worker.serve.test_worker_service import FakeGateway
from worker.serve.consumer import GROUP
from worker.serve.service import WorkerService
from worker.serve.settings import WorkerSettings

SYSTEM = ("The quick brown fox jumps over the lazy dog. Hello world, hello engine, hello batching "
          "and paged attention. continuous batching keeps the accelerator busy; static batching waits. ")


@pytest.fixture(scope="module")
def private_redis():
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(private_redis) -> str:
    import redis

    client = redis.Redis.from_url(private_redis.url)
    client.flushall()
    client.close()
    return private_redis.url


async def _until(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


#: The model the fleet's workers serve (``--served-model-name``), and another one.
MODEL, OTHER = "kv-model", "other-model"


class Fleet:
    """A fake gateway link server, workers ``w1`` and ``w2`` (with heartbeats) of ``MODEL``
    (``models`` names another model for some), and the gateway's router and producer on one Redis."""

    def __init__(self, redis_url: str, mode: str = "kv", workers: tuple[str, ...] = ("w1", "w2"),
                 models: dict[str, str] | None = None, claim_idle_ms: int = 500):
        self.redis_url, self.mode, self.ids, self.claim_idle_ms = redis_url, mode, workers, claim_idle_ms
        self.models = {w: (models or {}).get(w, MODEL) for w in workers}
        self.ran: dict[str, list[str]] = {w: [] for w in workers}  # request ids each engine was given
        self.port = free_port()
        self.services: dict[str, WorkerService] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    async def __aenter__(self):
        self.gateway = FakeGateway()
        self.server = grpc.aio.server()
        link_pb2_grpc.add_LinkServicer_to_server(self.gateway, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        self.redis = aioredis.Redis.from_url(self.redis_url)
        for worker in self.ids:
            await self.start(worker)
        self.router = KvRouter(self.redis, RouterConfig(mode=self.mode))
        self.metrics = GatewayMetrics()
        self.queue = RequestQueue(self.redis, self.router, self.metrics)
        await _until(self._all_published)
        return self

    async def _all_published(self) -> bool:
        return all([await self.redis.exists(kv_load_key(w)) for w in self.services])

    async def start(self, worker: str) -> None:
        await self.redis.set(heartbeat_key(worker), json.dumps({"model": self.models[worker]}), ex=30)
        engine = make_engine(num_blocks=64, block_size=4, enable_kv_events=True)
        add = engine.add_request
        engine.add_request = lambda request, *a, **kw: (self.ran[worker].append(request.request_id),
                                                        add(request, *a, **kw))[1]
        settings = WorkerSettings(redis_url=self.redis_url, worker_id=worker, poll_ms=20, health_port=0,
                                  claim_idle_ms=self.claim_idle_ms, served_model_name=(self.models[worker],))
        self.services[worker] = WorkerService(settings, engine, self.redis, "fake")
        self.tasks[worker] = asyncio.create_task(self.services[worker].run())

    async def stop(self, worker: str) -> None:
        """Drain ``worker`` as SIGTERM does: its heartbeat goes, the service stops."""
        await self.redis.delete(heartbeat_key(worker))
        self.services[worker].stop()
        await asyncio.wait_for(self.tasks.pop(worker), 10)

    async def __aexit__(self, *exc):
        for worker in list(self.tasks):
            await self.stop(worker)
        await self.server.stop(0)
        await self.redis.aclose()
        for service in self.services.values():
            stats = service.engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks

    async def enqueue(self, request_id: str, prompt: str, max_tokens: int = 4, model: str = MODEL):
        request = queue_pb2.QueuedRequest(
            request_id=request_id, tenant="t", prompt_token_ids=fake_tokenizer().encode(prompt),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            priority=1, reply_to=f"127.0.0.1:{self.port}", enqueued_unix_s=time.time(), model=model)
        return await self.queue.enqueue(request)

    async def finished(self, *request_ids: str) -> None:
        async def done() -> bool:
            return all(r in self.gateway.finished for r in request_ids)
        await _until(done)

    def holder(self, prompt: str, model: str = MODEL) -> str:
        """The worker of ``model`` whose engine served a prompt with this prefix (its prefix
        cache holds it)."""
        held = [w for w, s in self.services.items() if s.engine.stats().prefix_cache_queries and
                s.engine.cached_block_hashes() and self.models[w] == model]
        assert len(held) == 1, held
        return held[0]

    async def published(self, worker: str) -> None:
        async def has_blocks() -> bool:
            return await self.redis.scard(kv_blocks_key(worker)) > 0
        await _until(has_blocks)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


def test_a_prefix_one_worker_holds_is_routed_to_its_own_stream_and_hits_its_cache(redis_url):
    async def scenario():
        async with Fleet(redis_url) as f:
            first = await f.enqueue("a", SYSTEM + "first question?")
            assert first.stream == stream_name(1, MODEL)  # nobody holds it yet
            await f.finished("a")
            warm = f.holder(SYSTEM)
            await f.published(warm)
            for i in range(4):
                ticket = await f.enqueue(f"b{i}", SYSTEM + f"another question number {i}?")
                assert ticket.stream == worker_stream(1, warm, MODEL)
                await f.finished(f"b{i}")
                usage = f.gateway.finished[f"b{i}"].usage
                assert usage.cached_prompt_tokens >= usage.prompt_tokens // 2
            cold = next(w for w in f.ids if w != warm)
            assert not f.services[cold].engine.stats().prefix_cache_queries  # never ran one
            assert f.metrics.routed.labels(target="worker")._value.get() == 4
            other = await f.enqueue("c", "Emoji: rocket fire grin, thumbs. " * 3)
            assert other.stream == stream_name(1, MODEL)  # unrelated prompt: nobody stands out
            await f.finished("c")
    run(scenario())


def test_only_workers_of_the_requests_model_are_routed_to_and_read_its_streams(redis_url):
    """``w3`` serves another model and holds the prompt's prefix (it served it for its own
    model): a request for ``MODEL`` is never put on its own stream nor read by it; the
    workers of ``MODEL`` serve it from their model's shared stream, then their own."""
    async def scenario():
        async with Fleet(redis_url, workers=("w1", "w2", "w3"), models={"w3": OTHER}) as f:
            other = await f.enqueue("o", SYSTEM + "q?", model=OTHER)
            assert other.stream == stream_name(1, OTHER)
            await f.finished("o")
            assert f.holder(SYSTEM, OTHER) == "w3"
            await f.published("w3")
            f.router._read_at.clear()
            first = await f.enqueue("a", SYSTEM + "q2?")
            assert first.stream == stream_name(1, MODEL)  # w3 holds the prefix, but serves another model
            await f.finished("a")
            warm = f.holder(SYSTEM)
            await f.published(warm)
            f.router._read_at.clear()
            assert (await f.enqueue("b", SYSTEM + "q3?")).stream == worker_stream(1, warm, MODEL)
            await f.finished("b")
            assert warm in ("w1", "w2") and f.ran["w3"] == ["o"], f.ran
            assert sorted(f.ran["w1"] + f.ran["w2"]) == ["a", "b"]
    run(scenario())


def test_routing_off_queues_everything_on_the_shared_stream(redis_url):
    async def scenario():
        async with Fleet(redis_url, mode="shared") as f:
            await f.enqueue("a", SYSTEM + "q?")
            await f.finished("a")
            await f.published(f.holder(SYSTEM))
            assert (await f.enqueue("b", SYSTEM + "q2?")).stream == stream_name(1, MODEL)
            await f.finished("b")
    run(scenario())


def test_a_drained_worker_is_no_longer_routed_to_and_its_own_stream_is_taken_over(redis_url):
    async def scenario():
        async with Fleet(redis_url) as f:
            await f.enqueue("a", SYSTEM + "q?")
            await f.finished("a")
            warm = f.holder(SYSTEM)
            await f.published(warm)
            await f.stop(warm)  # drained: withdraws its load, leaves the registry once empty
            assert not await f.redis.exists(kv_load_key(warm))
            f.router._read_at.clear()  # do not wait for the registry's second
            assert (await f.enqueue("b", SYSTEM + "q2?")).stream == stream_name(1, MODEL)
            # an entry that reached the gone worker's own stream anyway (a racing XADD)
            await f.redis.xgroup_create(worker_stream(1, warm, MODEL), GROUP, id="0", mkstream=True)
            request = queue_pb2.QueuedRequest(
                request_id="late", prompt_token_ids=fake_tokenizer().encode("hello world"), priority=1,
                sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                reply_to=f"127.0.0.1:{f.port}", enqueued_unix_s=time.time(), model=MODEL)
            await f.redis.xadd(worker_stream(1, warm, MODEL), {"req": request.SerializeToString()})
            await f.redis.sadd(router_workers(MODEL), warm)
            await f.finished("b", "late")
            assert f.gateway.accepted.count("late") == 1

            async def forgotten() -> bool:  # emptied: the stream and the registration are gone
                return not await f.redis.exists(worker_stream(1, warm, MODEL)) and \
                    not await f.redis.sismember(router_workers(MODEL), warm)
            await _until(forgotten)
    run(scenario())


def test_a_dead_workers_own_stream_and_its_unacknowledged_entry_are_served_by_the_others(redis_url):
    """A worker SIGKILLed with one entry read but not acknowledged and one still queued on
    its own stream: the live worker serves both, each once."""
    async def scenario():
        async with Fleet(redis_url, workers=("w1",)) as f:
            dead = "dead-w9"
            stream = worker_stream(1, dead, MODEL)
            await f.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            await f.redis.sadd(router_workers(MODEL), dead)
            for rid in ("read", "queued"):
                request = queue_pb2.QueuedRequest(
                    request_id=rid, prompt_token_ids=fake_tokenizer().encode("hello world"), priority=1,
                    sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                    reply_to=f"127.0.0.1:{f.port}", enqueued_unix_s=time.time(), model=MODEL)
                await f.redis.xadd(stream, {"req": request.SerializeToString()})
                if rid == "read":  # the dead worker read it and died before its XACK
                    await f.redis.xreadgroup(GROUP, dead, {stream: ">"}, count=1)
            await f.finished("read", "queued")
            assert f.gateway.accepted.count("read") == 1 and f.gateway.accepted.count("queued") == 1
    run(scenario())


def test_a_dead_workers_unacknowledged_entries_are_taken_once_its_heartbeat_is_gone(redis_url):
    """A worker SIGKILLed while it held entries it had read and not acknowledged (waiting for
    room, or dialling their gateway), on the shared stream and on its own: once its heartbeat
    is gone they are served by the live worker without waiting out ``claim_idle_ms`` (10
    minutes here; 30 s by default, twice the chaos soak's 15 s bound), each once."""
    async def scenario():
        f = Fleet(redis_url, workers=("w1",), claim_idle_ms=600_000)
        dead, client = "dead-w8", aioredis.Redis.from_url(redis_url)
        own = worker_stream(1, dead, MODEL)
        await client.sadd(router_workers(MODEL), dead)
        for rid, stream in (("held-shared", stream_name(1, MODEL)), ("held-own", own)):  # before w1 reads
            await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            request = queue_pb2.QueuedRequest(
                request_id=rid, prompt_token_ids=fake_tokenizer().encode("hello world"), priority=1,
                sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                reply_to=f"127.0.0.1:{f.port}", enqueued_unix_s=time.time(), model=MODEL)
            await client.xadd(stream, {"req": request.SerializeToString()})
            assert await client.xreadgroup(GROUP, dead, {stream: ">"}, count=1)  # read, never acknowledged
        await client.aclose()
        async with f:
            await f.finished("held-shared", "held-own")
            assert f.gateway.accepted.count("held-shared") == 1 and f.gateway.accepted.count("held-own") == 1
    run(scenario())


def test_queue_depth_counts_the_workers_own_streams(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        key = KeyRecord(key_id="k1", tenant="t")
        await client.xadd(stream_name(1, MODEL), {"req": b"x"})
        await client.xadd(worker_stream(1, "w1", MODEL), {"req": b"x"})
        limiter = Limiter(client)
        await limiter.admit(key, 1, [stream_name(1, MODEL)], 3)
        with pytest.raises(RateLimitError) as err:
            await limiter.admit(key, 1, [stream_name(1, MODEL), worker_stream(1, "w1", MODEL)], 2)
        assert err.value.code == "queue_full"
        await client.aclose()
    run(scenario())
