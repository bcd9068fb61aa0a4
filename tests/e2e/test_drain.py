"""SIGTERM drains a worker: it stops pulling, finishes what it runs, then exits."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from inflight.clients import rest_chat_stream
from inflight.promtext import sample_sum
from tests.e2e.test_readiness import spawn, status, wait_until
from tests.helpers.redis_server import free_port, start_redis

pytestmark = pytest.mark.e2e


def test_sigterm_finishes_running_requests(tmp_path):
    server = start_redis()
    rest, health = free_port(), free_port()
    gateway = spawn(["gateway", "--redis-url", server.url, "--rest-port", str(rest), "--grpc-port",
                     str(free_port()), "--link-port", str(free_port())], tmp_path / "gateway.log")
    worker = spawn(["worker", "--redis-url", server.url, "--health-port", str(health), "--grpc-health-port", "0",
                    "--dtype", "float32", "--kv-cache-mib", "128", "--warmup-tokens", "16"], tmp_path / "worker.log")
    try:
        wait_until(lambda: status(f"http://127.0.0.1:{rest}/ready") == 200, 120, "the stack")
        key = subprocess.run([sys.executable, "-m", "inflight.cli", "keys", "create", "--redis-url", server.url,
                              "--quiet"], capture_output=True, text=True, check=True).stdout.strip()

        async def scenario():
            base = f"http://127.0.0.1:{rest}"
            tasks = [asyncio.ensure_future(rest_chat_stream(base, key, f"Count to {n}.", max_tokens=48,
                                                            extra={"ignore_eos": True})) for n in (10, 20, 30)]
            while worker_running(health) < 3:
                await asyncio.sleep(0.05)
            worker.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        results = asyncio.run(asyncio.wait_for(scenario(), 120))
        for r in results:
            assert r.error is None, r.error
            assert r.completion_tokens == 48 and r.finish_reason == "length"
        assert worker.wait(30) == 0
    finally:
        for proc in (worker, gateway):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.stop()


def worker_running(health_port: int) -> float:
    """inflight_requests_running from the worker's /metrics (0 when unreadable)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{health_port}/metrics", timeout=2).read().decode()
    except OSError:
        return 0.0
    return sample_sum(text, "inflight_requests_running")
