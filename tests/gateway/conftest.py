"""Gateway test fixtures: one real gateway + one fake worker per session."""

from __future__ import annotations

import time

import pytest
import redis

from gateway import keys
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway


@pytest.fixture(scope="session")
def gateway(redis_server):
    gw = start_gateway(redis_server.url)
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def fake_worker(redis_server, gateway):
    worker = FakeWorker(redis_server.url).start()
    yield worker
    worker.stop()


@pytest.fixture()
def api_key(redis_url, gateway, fake_worker) -> str:
    """A fresh key (after FLUSHALL), with the fake worker alive and its heartbeat back in place."""
    fake_worker.check()
    client = redis.Redis.from_url(redis_url)
    _, plaintext = keys.create_key(client, "tenant-a", "test")
    deadline = time.monotonic() + 2
    while not client.keys("inflight:workers:*") and time.monotonic() < deadline:
        time.sleep(0.02)
    client.close()
    fake_worker.check()
    return plaintext


def wait_for(predicate, timeout_s: float = 3.0) -> bool:
    """Poll ``predicate`` every 20 ms until true or ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False
