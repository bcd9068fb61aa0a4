"""Scale from zero (deploy/k8s/keda.yaml with minReplicaCount 0): with ``require_worker``
off (``INFLIGHT_GATEWAY_REQUIRE_WORKER=0``) a gateway with no worker queues requests on
the shared stream, where KEDA's redis-streams scaler sees them as consumer-group lag;
a worker that starts later serves the whole backlog, each request once."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from common.redis_keys import GROUP, stream_name
from gateway import keys
from tests.gateway.fake_worker import MODEL
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import start_redis

BACKLOG = 6


def _lag(client: redis.Redis) -> int:
    """What KEDA's scaler reads: entries of the shared stream not yet delivered to the group
    (XLEN when the group does not exist yet, as nobody has read)."""
    groups = client.xinfo_groups(stream_name(1, MODEL)) if client.exists(stream_name(1, MODEL)) else []
    return next((int(g["lag"]) for g in groups if g["name"] == GROUP.encode() or g["name"] == GROUP),
                client.xlen(stream_name(1, MODEL)) if client.exists(stream_name(1, MODEL)) else 0)


def _start_worker(url: str, stop: threading.Event) -> threading.Thread:
    from tests.worker.engine_helpers import make_engine
    from worker.serve.main import redis_client
    from worker.serve.service import WorkerService
    from worker.serve.settings import WorkerSettings

    def main() -> None:
        async def serve() -> None:
            client = redis_client(url)
            settings = WorkerSettings(redis_url=url, worker_id="from-zero", poll_ms=20, health_port=0, served_model_name=(MODEL,),
                                      grpc_health_port=0)
            service = WorkerService(settings, make_engine(num_blocks=128, block_size=4), client, "fake")
            task = asyncio.create_task(service.run())
            while not stop.is_set():
                await asyncio.sleep(0.05)
            service.stop()
            await asyncio.wait_for(task, 10)
            await client.aclose()
        asyncio.run(serve())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread


def test_requests_queued_with_no_worker_are_served_once_one_starts():
    server = start_redis()
    client = redis.Redis.from_url(server.url)
    _, key = keys.create_key(client, "t", "scale from zero")
    gw = start_gateway(server.url, require_worker=False, request_timeout_s=60.0)
    stop = threading.Event()
    worker = None
    try:
        assert httpx.get(f"{gw.rest_url}/ready", timeout=2).status_code == 503  # no worker yet

        def complete(i: int) -> httpx.Response:
            return httpx.post(f"{gw.rest_url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                              json={"model": "test-model", "prompt": f"hi {i}", "max_tokens": 5, "ignore_eos": True,
                                    "temperature": 0})
        with ThreadPoolExecutor(BACKLOG) as pool:
            futures = [pool.submit(complete, i) for i in range(BACKLOG)]
            deadline = time.monotonic() + 10
            while _lag(client) < BACKLOG:
                assert time.monotonic() < deadline, "the requests were not queued"
                time.sleep(0.05)
            assert not any(f.done() for f in futures)  # queued, waiting: not refused
            worker = _start_worker(server.url, stop)
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * BACKLOG
        assert all(a.json()["usage"]["completion_tokens"] == 5 for a in answers)
        assert _lag(client) == 0 and client.xlen(stream_name(1, MODEL)) == 0
    finally:
        stop.set()
        if worker is not None:
            worker.join(15)
        gw.stop()
        client.close()
        server.stop()
