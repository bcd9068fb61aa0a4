"""Readiness that means ready: the worker only after its warm-up forward pass, the
gateway only while a worker heartbeat exists (and not after that worker drains)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import redis

from tests.helpers.redis_server import free_port, start_redis

pytestmark = pytest.mark.e2e


def status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None  # not listening yet


def spawn(args: list[str], log_path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "inflight.cli", *args], stdout=open(log_path, "wb"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_worker_ready_after_warmup_and_gateway_only_with_a_heartbeat(tmp_path):
    server = start_redis()
    rest, health = free_port(), free_port()
    gateway = spawn(["gateway", "--redis-url", server.url, "--rest-port", str(rest), "--grpc-port",
                     str(free_port()), "--link-port", str(free_port())], tmp_path / "gateway.log")
    worker = None
    try:
        gw_ready = f"http://127.0.0.1:{rest}/ready"
        wait_until(lambda: status(gw_ready) is not None, 60, "the gateway to listen")
        assert status(gw_ready) == 503  # Redis answers, but no worker heartbeat yet

        worker = spawn(["worker", "--redis-url", server.url, "--health-port", str(health), "--dtype",
                        "float32", "--kv-cache-mib", "128", "--warmup-tokens", "2048"], tmp_path / "worker.log")
        ready_url = f"http://127.0.0.1:{health}/ready"
        wait_until(lambda: status(f"http://127.0.0.1:{health}/health") == 200, 120, "worker liveness")
        seen = []
        wait_until(lambda: seen.append(status(ready_url)) or seen[-1] == 200, 120, "worker readiness")
        assert 503 in seen, "the worker said ready before its warm-up pass finished"
        log = (tmp_path / "worker.log").read_text()
        assert "warm-up forward pass of 2048 tokens" in log

        wait_until(lambda: status(gw_ready) == 200, 10, "the gateway to see the heartbeat")
        client = redis.Redis.from_url(server.url)
        assert list(client.scan_iter(match="inflight:workers:*"))

        worker.send_signal(signal.SIGTERM)  # drain: heartbeat removed, gateway no longer ready
        worker.wait(30)
        assert not list(client.scan_iter(match="inflight:workers:*"))
        assert status(gw_ready) == 503
        client.close()
    finally:
        for proc in (worker, gateway):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        server.stop()
