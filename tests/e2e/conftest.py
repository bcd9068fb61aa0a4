"""The whole stack with the real SmolLM2 model: private Redis, worker and gateway
processes, and real nginx in front (installed by .ci/run)."""

from __future__ import annotations

import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from stack.edge import nginx_binary
from common.promtext import sample_sum
from stack.stack import Stack, StackSettings
from tests.helpers.redis_server import free_port, start_redis


@pytest.fixture(scope="session")
def stack():
    """One running stack for every end-to-end test (model load is the slow part)."""
    if nginx_binary() is None:
        pytest.fail("nginx is required for the end-to-end tests (.ci/run installs it)")
    redis = start_redis()
    run_dir = Path(tempfile.mkdtemp(prefix="inflight-e2e-"))
    settings = StackSettings(
        run_dir=run_dir, redis_url=redis.url, rest_port=free_port(), grpc_port=free_port(),
        link_port=free_port(), worker_health_port=free_port(), worker_grpc_health_port=free_port(),
        edge_rest_port=free_port(), edge_grpc_port=free_port(),
        # The tests send bursts from one address and key; the edge limits are tested on their own.
        edge_overrides={"ip_rate": 1000, "ip_burst": 1000, "key_rate": 1000, "key_burst": 1000},
        worker_args=("--device", "cpu", "--dtype", "float32", "--kv-cache-mib", "256"))
    s = Stack(settings)
    try:
        s.start()
    except BaseException:  # pytest-timeout's Failed too, or Redis and the worker outlive the run
        s.stop()
        redis.stop()
        raise
    yield s
    s.stop()
    redis.stop()


@pytest.fixture(scope="session")
def api_key(stack) -> str:
    """A fresh API key in the stack's Redis."""
    return stack.create_key(tenant="e2e", name="tests")


@pytest.fixture(scope="session")
def rest_url(stack) -> str:
    """Base URL of the REST API through nginx."""
    return stack.endpoints()["rest"]


@pytest.fixture(scope="session")
def grpc_address(stack) -> str:
    """host:port of the gRPC API through nginx."""
    return stack.endpoints()["grpc"]


def worker_gauge(stack, name: str) -> float:
    """Read one gauge from the worker's /metrics (first sample of that name)."""
    url = stack.endpoints()["worker_metrics"]
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    if f"\n{name}{{" not in text:
        raise AssertionError(f"{name} not in worker metrics")
    return sample_sum(text, name)


def wait_all_blocks_free(stack, timeout_s: float = 10.0) -> None:
    """Wait until the worker reports no running sequence and every KV block free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = worker_gauge(stack, "inflight_kv_blocks_free")
        total = worker_gauge(stack, "inflight_kv_blocks_total")
        if total > 0 and free == total and worker_gauge(stack, "inflight_requests_running") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"KV blocks not all free: {free}/{total}")
