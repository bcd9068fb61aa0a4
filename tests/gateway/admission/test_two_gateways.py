"""Two real gateway processes (``python -m inflight.cli gateway``, real SmolLM2 tokenizer)
sharing one Redis: the per-key windows are exact across both under 200 concurrent requests,
and so are the ``x-ratelimit-remaining-*`` headers each process sends."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest
import redis

from gateway import keys
from gateway.admission.ratelimit import window_usage
from tests.gateway.fake_worker import MODEL
from tests.helpers.redis_server import free_port

N = 200


def _tokenizer_available() -> bool:
    try:
        from common.model_files import resolve_model_path
        resolve_model_path(None)
        return True
    except (ImportError, FileNotFoundError):
        return False


pytestmark = pytest.mark.skipif(not _tokenizer_available(), reason="SmolLM2 tokenizer unavailable")


@pytest.fixture(scope="module")
def two_gateways(redis_server):
    procs, urls = [], []
    for _ in range(2):
        rest = free_port()
        cmd = [sys.executable, "-m", "inflight.cli", "gateway", "--redis-url", redis_server.url,
               "--host", "127.0.0.1", "--rest-port", str(rest), "--grpc-port", str(free_port()),
               "--link-port", str(free_port()), "--model", f"{MODEL}=smollm2"]  # the fake worker's model
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        urls.append(f"http://127.0.0.1:{rest}")
    try:
        deadline = time.monotonic() + 60
        for url, proc in zip(urls, procs):
            while True:
                assert proc.poll() is None, "gateway process exited"
                assert time.monotonic() < deadline, "gateway process did not start"
                try:
                    if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _heartbeat_back(client: redis.Redis) -> None:
    """Wait for the fake worker's heartbeat after the FLUSHALL of ``redis_url``: these
    gateways require a worker, and one that looks while the key is gone answers 503
    ``no_worker`` (seen once in CI as a 503 among the expected 429s)."""
    deadline = time.monotonic() + 2
    while not client.keys("inflight:workers:*") and time.monotonic() < deadline:
        time.sleep(0.02)


async def _burst(urls, key, body):
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=N)) as client:
        return await asyncio.gather(*(
            client.post(urls[i % 2] + "/v1/completions", json=body, headers=headers)
            for i in range(N)))


def test_requests_per_min_exact_across_two_processes(two_gateways, redis_url, fake_worker):
    client = redis.Redis.from_url(redis_url)
    key_id, key = keys.create_key(client, "tenant-mp", "rpm", requests_per_min=50)
    _heartbeat_back(client)
    replies = asyncio.run(_burst(two_gateways, key, {"prompt": "hi", "max_tokens": 2}))
    statuses = [r.status_code for r in replies]
    assert statuses.count(200) == 50 and statuses.count(429) == N - 50, statuses
    assert {r.json()["error"]["code"] for r in replies if r.status_code == 429} == {"key_rate"}
    # each process got 100 requests; separate windows would have admitted 50 in each
    for start in (0, 1):
        assert [r.status_code for r in replies[start::2]].count(429) >= 50
    assert window_usage(client, key_id)["requests"] == 50
    # every admitted request saw a different count, whichever process admitted it
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in replies
                       if r.status_code == 200)
    assert remaining == list(range(50))
    assert {r.headers["x-ratelimit-remaining-requests"] for r in replies if r.status_code == 429} == {"0"}
    assert {r.headers["x-ratelimit-limit-requests"] for r in replies} == {"50"}
    assert all(int(r.headers["x-ratelimit-remaining-requests"]) < 50 for r in replies[0::2])


def test_tokens_per_min_holds_across_two_processes(two_gateways, redis_url, fake_worker):
    client = redis.Redis.from_url(redis_url)
    limit = 1000
    key_id, key = keys.create_key(client, "tenant-mp", "tpm", tokens_per_min=limit)
    _heartbeat_back(client)
    # max_tokens=5: the fake worker generates exactly 5, so nothing is refunded and the
    # window holds the admitted reservations (prompt + max_tokens) themselves.
    replies = asyncio.run(_burst(two_gateways, key, {"prompt": "hello world", "max_tokens": 5}))
    ok = [r for r in replies if r.status_code == 200]
    rejected = [r for r in replies if r.status_code != 200]
    assert {r.status_code for r in rejected} == {429}, [r.text for r in rejected if r.status_code != 429][:3]
    assert {r.json()["error"]["code"] for r in rejected} == {"key_tokens"}
    usage = {(r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]) for r in ok}
    assert len(usage) == 1
    prompt, completion = usage.pop()
    cost = prompt + 5
    assert completion == 5
    assert len(ok) * cost <= limit
    assert len(ok) == limit // cost  # exact: no over- and no under-admission
    assert window_usage(client, key_id)["tokens"] == len(ok) * cost <= limit
    remaining = sorted(int(r.headers["x-ratelimit-remaining-tokens"]) for r in ok)
    assert remaining == sorted(limit - k * cost for k in range(1, len(ok) + 1))
    assert {r.headers["x-ratelimit-limit-tokens"] for r in replies} == {str(limit)}
