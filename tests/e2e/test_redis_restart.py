"""A Redis restart under load (issue 8 item 3): a real worker and gateway, a private
redis-server stopped and started again on the same port.

1. With AOF persistence (``SHUTDOWN SAVE``) while 12 streams run or wait in the queue:
   running streams finish, requests sent while Redis is down get a clear 503/UNAVAILABLE
   (OpenAI-shaped body) instead of hanging, queued requests survive and complete, later
   requests succeed, and the consumer group is still there.
2. A restart that lost everything (``SHUTDOWN NOSAVE`` + empty data dir) while 8 streams run
   and 4 wait in the queue: all 12 finish (the gateway queues the lost entries again), the old
   API key is gone (401), the worker recreates its consumer group
   (NOGROUP) and re-registers its heartbeat, and a new key's requests succeed.

Every request is accounted for: completed, or a clear error; none lost (accepted but
neither finished nor failed).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from common.redis_keys import stream_name
from common.served_model import DEFAULT_SERVED_NAME
from stack.clients import StreamResult, grpc_chat_stream, rest_chat_stream
from tests.e2e.procs import create_key, kill_all
from tests.e2e.test_drain import worker_running
from tests.e2e.test_readiness import spawn, status, wait_until
from tests.helpers.redis_server import free_port, start_redis

pytestmark = pytest.mark.e2e

HANG_GUARD_S = 30.0  # a request still open after this long during the outage counts as a hang
MAX_TOKENS = (16, 24, 32, 40, 48)


def stream(base: str, key: str, n: int, max_tokens: int):
    return asyncio.ensure_future(rest_chat_stream(base, key, f"Count to {n}.", max_tokens=max_tokens,
                                                  extra={"ignore_eos": True}, timeout_s=60))


def completed(r: StreamResult, max_tokens: int) -> bool:
    return r.error is None and r.finish_reason == "length" and r.completion_tokens == max_tokens


def lost(results: list[StreamResult]) -> list[StreamResult]:
    """Requests that neither finished nor ended with a clear error."""
    return [r for r in results if r.finish_reason is None and not r.error]


def openai_503(r: StreamResult) -> dict:
    """The error object of an ``HTTP 503: {...}`` result (AssertionError otherwise)."""
    assert r.error is not None and r.error.startswith("HTTP 503: "), r.error
    return json.loads(r.error.removeprefix("HTTP 503: "))["error"]


async def wait_running(health: int, n: int) -> None:
    while worker_running(health) < n:
        await asyncio.sleep(0.05)


def test_redis_restart_under_load(tmp_path):
    server = start_redis(persistent=True)
    rest, grpc_port, health = free_port(), free_port(), free_port()
    gateway = spawn(["gateway", "--redis-url", server.url, "--rest-port", str(rest), "--grpc-port",
                     str(grpc_port), "--link-port", str(free_port())], tmp_path / "gateway.log")
    worker = spawn(["worker", "--redis-url", server.url, "--health-port", str(health), "--grpc-health-port", "0",
                    "--dtype", "float32", "--kv-cache-mib", "128", "--warmup-tokens", "16", "--max-batch-size", "8"],
                   tmp_path / "worker.log")
    base, ready = f"http://127.0.0.1:{rest}", f"http://127.0.0.1:{rest}/ready"
    client = redis.Redis.from_url(server.url)
    try:
        wait_until(lambda: status(ready) == 200, 120, "the stack")
        key = create_key(server.url)

        async def persistent_restart():
            # 12 streams on a batch of 8: 8 run, the rest wait in the Redis stream.
            load = [stream(base, key, i, MAX_TOKENS[i % len(MAX_TOKENS)]) for i in range(12)]
            await wait_running(health, 8)
            server.shutdown(save=True)
            down = [stream(base, key, 99, 16) for _ in range(3)]
            down_grpc = grpc_chat_stream(f"127.0.0.1:{grpc_port}", key, "hi", max_tokens=8, timeout_s=HANG_GUARD_S)
            down_results = await asyncio.wait_for(asyncio.gather(*down, down_grpc), HANG_GUARD_S)
            ready_while_down = status(ready)
            server.restart()
            return await asyncio.gather(*load), down_results, ready_while_down

        load, down_results, ready_while_down = asyncio.run(asyncio.wait_for(persistent_restart(), 120))
        for r in down_results[:3]:
            error = openai_503(r)
            assert error["type"] == "service_unavailable_error" and error["message"], error
        assert down_results[3].error.startswith("UNAVAILABLE"), down_results[3].error
        assert ready_while_down == 503
        assert lost(load) == []
        not_done = [(i, r.error) for i, r in enumerate(load) if not completed(r, MAX_TOKENS[i % len(MAX_TOKENS)])]
        assert not_done == [], "running and queued requests must survive a restart with AOF"
        after = asyncio.run(_three_later(base, key))
        assert all(completed(r, 16) for r in after), [r.error for r in after]
        assert b"inflight-workers" in [g["name"] for g in client.xinfo_groups(stream_name(1, DEFAULT_SERVED_NAME))]

        async def lossy_restart():
            # 12 on a batch of 8 again: the 4 queued entries die with Redis's data; the
            # gateway still holds them and queues them again (gateway/queue_watch.py)
            load = [stream(base, key, i, 32) for i in range(12)]
            await wait_running(health, 8)
            server.shutdown(save=False)
            server.restart(wipe=True)
            return await asyncio.gather(*load)

        load = asyncio.run(asyncio.wait_for(lossy_restart(), 120))
        assert [r.error for r in load if not completed(r, 32)] == [], \
            "running streams do not need Redis, and the queued ones are queued again"
        assert client.dbsize() == 0 or not client.exists("inflight:keys:ids")
        old_key = asyncio.run(_later(base, key, 0))
        assert old_key.error is not None and old_key.error.startswith("HTTP 401"), old_key.error
        wait_until(lambda: status(ready) == 200, 30, "the worker's heartbeat after the lossy restart")
        new_key = create_key(server.url)
        after = asyncio.run(_three_later(base, new_key))
        assert all(completed(r, 16) for r in after), [r.error for r in after]
        groups = client.xinfo_groups(stream_name(1, DEFAULT_SERVED_NAME))
        assert [g["name"] for g in groups] == [b"inflight-workers"] and groups[0]["pending"] == 0
        assert worker.poll() is None and gateway.poll() is None
    finally:
        client.close()
        kill_all((worker, gateway))
        server.stop()


async def _later(base: str, key: str, n: int) -> StreamResult:
    return await stream(base, key, n, 16)


async def _three_later(base: str, key: str) -> list[StreamResult]:
    return await asyncio.wait_for(asyncio.gather(*[_later(base, key, i) for i in range(3)]), 120)
