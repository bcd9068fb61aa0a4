"""common/fleet.py against a real Redis: workers from their heartbeats, their /metrics or, when
those do not answer, their load hash; queues of the shared and own streams; the 429s of the
last minute only; and the table `inflight status` draws from it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import redis.asyncio as aioredis

from common.fleet import collect_fleet, record_rejection
from common.redis_keys import stream_name, worker_stream
from tests.helpers.redis_server import start_redis

METRICS = b"""inflight_requests_running{model_name="m",worker="w1",batching="continuous"} 3.0
inflight_requests_waiting{model_name="m",worker="w1",batching="continuous"} 2.0
inflight_kv_cache_usage{model_name="m",worker="w1",batching="continuous"} 0.25
inflight_avg_prompt_throughput_toks_per_s{model_name="m",worker="w1",batching="continuous"} 12.5
inflight_avg_generation_throughput_toks_per_s{model_name="m",worker="w1",batching="continuous"} 40.0
"""


@pytest.fixture(scope="module")
def server():
    s = start_redis()
    yield s
    s.stop()


@pytest.fixture()
def metrics_url():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(METRICS)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    httpd.shutdown()


async def _scenario(url: str, metrics_url: str):
    client = aioredis.Redis.from_url(url)
    await client.flushall()
    now = time.time()
    await client.set("inflight:workers:w1", json.dumps({"model": "m", "batching": "continuous",
                                                        "started": now - 65, "metrics_url": metrics_url}))
    await client.set("inflight:workers:w2", json.dumps({"model": "m", "batching": "static", "started": now,
                                                        "metrics_url": "http://127.0.0.1:1/metrics"}))
    await client.hset("inflight:kv:w2:load", mapping={"running": 1, "waiting": 4, "free_blocks": 30,
                                                      "total_blocks": 40, "salt": "x",
                                                      "lora_salts": "{\"sql\": \"sql@1\"}"})
    await client.xadd(stream_name(1, "m"), {"r": "1"})
    await client.xadd(worker_stream(1, "w2", "m"), {"r": "2"})
    await client.xadd(stream_name(0, "m"), {"r": "3"})
    await client.xadd(stream_name(2, "scaled-to-zero"), {"r": "4"})  # a model with no worker now
    await record_rejection(client, "key_rate", now - 75)  # older than a minute: not counted
    await record_rejection(client, "key_rate", now - 30)
    await record_rejection(client, "queue_full", now)
    await record_rejection(client, "queue_full", now)
    async with httpx.AsyncClient() as http:
        view = await collect_fleet(client, http, models=("scaled-to-zero",))
    await client.aclose()
    return view


def test_fleet_from_heartbeats_metrics_load_hashes_streams_and_buckets(server, metrics_url):
    view = asyncio.run(_scenario(server.url, metrics_url))
    w1, w2 = view.workers
    assert (w1.worker_id, w1.source, w1.running, w1.waiting, w1.kv_usage, w1.prompt_tps, w1.generation_tps) == (
        "w1", "metrics", 3, 2, 0.25, 12.5, 40.0)
    assert 64 < w1.up_s < 70
    # w2's metrics do not answer: its load hash in Redis, no throughput
    assert (w2.source, w2.running, w2.waiting, w2.kv_usage, w2.generation_tps) == ("redis", 1, 4, 0.25, None)
    assert view.queue_depth == {0: 1, 1: 2, 2: 1}  # summed over the models
    assert view.rejections == {"key_rate": 1, "queue_full": 2}
    assert view.to_json()["generation_tps"] == 40.0 and view.to_json()["queue_depth"] == {"0": 1, "1": 2, "2": 1}

    from rich.console import Console

    from inflight.status import render

    console = Console(width=200, record=True)
    console.print(render(view))
    text = console.export_text()
    assert "w1" in text and "25.0%" in text and "40.0" in text and "1m 0" in text
    assert "queued: p0 1 · p1 2 · p2 1" in text and "429s in the last minute: key_rate 1, queue_full 2" in text
