"""Redis failover under load through Sentinel (common/redis_connect.py): a master, a
replica and three sentinels on this machine; a real gateway and a real worker service
(fake-runner engine) reach Redis with a ``redis+sentinel://`` URL; the master is killed
(SIGKILL) while requests stream.

Counted: every request sent gets an answer, either its whole completion (exactly
``max_tokens`` tokens: nothing served twice) or a clear error (503 with OpenAI's error
body, during the outage); none is left hanging (lost). A key's requests/min window written
before the kill (and replicated) still refuses after the failover. ``/ready`` answers 503
and ``inflight_gateway_redis_up`` reads 0 during the outage, both recover after it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.promtext import sample_sum
from common.redis_connect import sync_client
from gateway import keys
from tests.gateway.fake_worker import MODEL
from tests.gateway.harness import start_gateway
from tests.helpers.redis_sentinel import start_sentinel_set

MAX_TOKENS = 40
NUM_REQUESTS = 60


@pytest.fixture()
def sentinels():
    s = start_sentinel_set()
    yield s
    s.stop()


def _run_worker(url: str, stop: threading.Event) -> threading.Thread:
    """A worker service (fake runner, 10 ms steps) on ``url`` with its heartbeat."""
    from tests.worker.engine_helpers import make_engine
    from worker.serve.main import redis_client
    from worker.serve.service import WorkerService
    from worker.serve.settings import WorkerSettings

    def main() -> None:
        async def serve() -> None:
            client = redis_client(url)
            settings = WorkerSettings(redis_url=url, worker_id="sentinel-w1", poll_ms=20, health_port=0, served_model_name=(MODEL,),
                                      grpc_health_port=0, claim_idle_ms=1000)
            engine = make_engine(num_blocks=256, block_size=4)
            step = engine.step
            engine.step = lambda: (time.sleep(0.01), step())[1]
            service = WorkerService(settings, engine, client, "fake")
            task = asyncio.create_task(service.run())
            while not stop.is_set():
                try:
                    await client.set("inflight:workers:sentinel-w1", json.dumps({"model": MODEL}), ex=10)
                except Exception:  # noqa: BLE001 - Redis is failing over
                    pass
                await asyncio.sleep(0.2)
            service.stop()
            await asyncio.wait_for(task, 10)
            await client.aclose()
        asyncio.run(serve())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread


def _watch(url: str, stop: threading.Event, seen: list[tuple[int, float]]) -> None:
    """Record (``/ready`` status, ``inflight_gateway_redis_up``) every 0.1 s."""
    with httpx.Client(timeout=3) as client:
        while not stop.is_set():
            try:
                ready = client.get(f"{url}/ready").status_code
                up = sample_sum(client.get(f"{url}/metrics").text, "inflight_gateway_redis_up")
                seen.append((ready, up))
            except httpx.HTTPError:
                pass
            time.sleep(0.1)


def _complete(url: str, key: str, i: int, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                      json={"model": "test-model", "prompt": f"hello {i}", "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True})


def _replicated(sentinels) -> bool:
    """True once the replica has every write the master has (replication offsets)."""
    import redis

    master = sentinels.master().info("replication")
    replica = redis.Redis(port=sentinels.replica_port).info("replication")
    return replica.get("slave_repl_offset", -1) >= master["master_repl_offset"]


def test_master_killed_under_load_every_request_completes_or_fails_clearly(sentinels):
    admin = sync_client(sentinels.url(), socket_timeout=2)
    _, key = keys.create_key(admin, "load", "sentinel test")
    _, limited = keys.create_key(admin, "limited", "sentinel test", requests_per_min=3)
    gw = start_gateway(sentinels.url(), require_worker=True, request_timeout_s=30.0)
    stop = threading.Event()
    worker = _run_worker(sentinels.url(), stop)
    seen: list[tuple[int, float]] = []
    watcher = threading.Thread(target=_watch, args=(gw.rest_url, stop, seen), daemon=True)
    try:
        deadline = time.monotonic() + 10
        while httpx.get(f"{gw.rest_url}/ready", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "the gateway never saw the worker"
            time.sleep(0.1)
        watcher.start()
        for i in range(3):  # the limited key's window is full, and replicated, before the kill
            assert _complete(gw.rest_url, limited, i, max_tokens=1).status_code == 200
        assert _complete(gw.rest_url, limited, 3, max_tokens=1).status_code == 429
        deadline = time.monotonic() + 5
        while not _replicated(sentinels):
            assert time.monotonic() < deadline, "the replica did not catch up"
            time.sleep(0.05)

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            futures = []
            for i in range(NUM_REQUESTS):
                futures.append(pool.submit(_complete, gw.rest_url, key, i))
                time.sleep(0.1)
                if i == NUM_REQUESTS // 4:
                    old, killed_at = sentinels.kill_master(), time.monotonic()
            sentinels.wait_failover(old)
            failover_s = time.monotonic() - killed_at  # an upper bound: the sends went on meanwhile
            answers = [f.result() for f in futures]  # an exception here: a request left hanging

        done = [a for a in answers if a.status_code == 200]
        failed = [a for a in answers if a.status_code != 200]
        assert len(done) + len(failed) == NUM_REQUESTS
        assert all(a.json()["usage"]["completion_tokens"] == MAX_TOKENS for a in done)  # none served twice
        for a in failed:  # a clear error: 503 "retry" with OpenAI's body, never a 500 or a timeout
            assert a.status_code == 503, a.text
            assert a.json()["error"]["code"] in ("redis_unavailable", "no_worker"), a.text
        print(f"failover within {failover_s:.1f} s: {len(done)} completed, {len(failed)} got 503")  # for the record (-s)

        assert _complete(gw.rest_url, limited, 9, max_tokens=1).status_code == 429  # still limited
        assert _complete(gw.rest_url, key, 99).status_code == 200  # served on the new master
        deadline = time.monotonic() + 10
        while not seen or seen[-1] != (200, 1.0):
            assert time.monotonic() < deadline, f"not ready again: {seen[-3:]}"
            time.sleep(0.1)
        # the outage showed on /ready and in the metrics (read one after the other, so not
        # necessarily in the same sample)
        assert any(ready == 503 for ready, _ in seen) and any(up == 0.0 for _, up in seen)
    finally:
        stop.set()
        worker.join(15)
        gw.stop()
        admin.close()
