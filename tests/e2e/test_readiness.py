"""Readiness that means ready: the worker only after its warm-up forward pass (HTTP
/ready and the grpc.health.v1 service alike), the gateway only while a worker
heartbeat exists (and not after that worker drains)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.helpers.redis_server import free_port, start_redis

pytestmark = pytest.mark.e2e
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


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


class HealthWatch:
    """Follows a worker's ``grpc.health.v1.Health/Watch`` stream from a thread.

    ``seen`` gets one ``(status, http_ready, warm_logged)`` per message: the gRPC
    status, the HTTP ``/ready`` code read right after it (None: not listening) and
    whether the worker log already has the warm-up line; ``ended`` is the gRPC code
    that closed the stream.
    """

    def __init__(self, address: str, ready_url: str, log_path):
        self.channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(self.channel).result(timeout=120)
        self.seen: list[tuple[int, int | None, bool]] = []
        self.ended = None
        call = health_pb2_grpc.HealthStub(self.channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=600)

        def follow():
            try:
                for resp in call:
                    warm = "tokens: done in" in log_path.read_text()  # the warm-up's end (common/progress.py)
                    self.seen.append((resp.status, status(ready_url), warm))
            except grpc.RpcError as exc:
                self.ended = exc.code()

        self.thread = threading.Thread(target=follow, daemon=True)
        self.thread.start()

    def statuses(self) -> list[int]:
        """The statuses seen, repeats collapsed."""
        out = []
        for st, _, _ in self.seen:
            if not out or out[-1] != st:
                out.append(st)
        return out


def test_worker_ready_after_warmup_and_gateway_only_with_a_heartbeat(tmp_path):
    server = start_redis()
    rest, health, grpc_health = free_port(), free_port(), free_port()
    gateway = spawn(["gateway", "--redis-url", server.url, "--rest-port", str(rest), "--grpc-port",
                     str(free_port()), "--link-port", str(free_port())], tmp_path / "gateway.log")
    worker = None
    try:
        gw_ready = f"http://127.0.0.1:{rest}/ready"
        wait_until(lambda: status(gw_ready) is not None, 60, "the gateway to listen")
        assert status(gw_ready) == 503  # Redis answers, but no worker heartbeat yet

        worker = spawn(["worker", "--redis-url", server.url, "--health-port", str(health), "--grpc-health-port",
                        str(grpc_health), "--dtype", "float32", "--kv-cache-mib", "128", "--warmup-tokens", "2048"],
                       tmp_path / "worker.log")
        ready_url = f"http://127.0.0.1:{health}/ready"
        # The gRPC health server is up before the model loads: watch it from the start.
        watch = HealthWatch(f"127.0.0.1:{grpc_health}", ready_url, tmp_path / "worker.log")
        services = ProtoReflectionDescriptorDatabase(watch.channel).get_services()
        assert "grpc.health.v1.Health" in services, services
        wait_until(lambda: status(f"http://127.0.0.1:{health}/health") == 200, 120, "worker liveness")
        seen = []
        wait_until(lambda: seen.append(status(ready_url)) or seen[-1] == 200, 120, "worker readiness")
        assert 503 in seen, "the worker said ready before its warm-up pass finished"
        log = (tmp_path / "worker.log").read_text()
        assert "warm-up forward pass of 2048 tokens: done in" in log
        wait_until(lambda: SERVING in watch.statuses(), 10, "gRPC health SERVING")
        assert watch.statuses()[0] == NOT_SERVING, "gRPC health said SERVING before the warm-up pass finished"
        _, http_ready, warm_logged = next(item for item in watch.seen if item[0] == SERVING)
        assert warm_logged and http_ready == 200  # same moment as /ready, after the warm-up

        wait_until(lambda: status(gw_ready) == 200, 10, "the gateway to see the heartbeat")
        client = redis.Redis.from_url(server.url)
        assert list(client.scan_iter(match="inflight:workers:*"))

        worker.send_signal(signal.SIGTERM)  # drain: heartbeat removed, gateway no longer ready
        worker.wait(30)
        watch.thread.join(10)
        assert watch.statuses() == [NOT_SERVING, SERVING, NOT_SERVING], watch.seen
        assert watch.seen[-1][1] != 200  # /ready stopped saying ready no later than gRPC did
        assert watch.ended is not None  # the stream closed when the worker exited
        watch.channel.close()
        assert not list(client.scan_iter(match="inflight:workers:*"))
        assert status(gw_ready) == 503
        client.close()
    finally:
        for proc in (worker, gateway):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        server.stop()
