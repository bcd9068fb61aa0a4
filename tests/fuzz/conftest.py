"""Fuzz fixtures: per test module, a private Redis, a real gateway on it and the fake
worker answering over the real gRPC link (tests/gateway/harness.py,
tests/gateway/fake_worker.py), shared with no other test directory (another fake
worker on the same Redis would take requests and hide them from ``fuzz_worker``);
and the Hypothesis settings every fuzz test uses.

Example counts: ``FUZZ_EXAMPLES`` (per generated test) defaults to a small CI budget
and runs derandomized, so CI replays the same cases; ``make fuzz`` sets it to 2000 and
lets Hypothesis pick fresh cases each run.
"""

from __future__ import annotations

import os
import time

import pytest
import redis
from hypothesis import HealthCheck, settings

from gateway import keys
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import start_redis

CI_EXAMPLES = 30
FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", CI_EXAMPLES))
CALL_TIMEOUT_S = 10.0  # per fuzzed call: a request that takes longer counts as a hang

settings.register_profile(
    "fuzz", max_examples=FUZZ_EXAMPLES, deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ,
    database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                           HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
FUZZ = settings.get_profile("fuzz")  # applied per test (@FUZZ), never loaded globally

# The fake worker's scripted triggers (tests/gateway/fake_worker.py): "slow" streams
# 500 pieces, "fail" finishes with a worker error (a 500 by design). Hypothesis mines
# string constants from local modules, so a fuzzed prompt can hold them: such cases
# are skipped (assume), they test the script, not the gateway.
SCRIPT_TRIGGERS = ("slow", "fail")


def scripted(text: str) -> bool:
    """True when ``text`` would trigger the fake worker's script."""
    return any(t in text for t in SCRIPT_TRIGGERS)


@pytest.fixture(scope="module")
def fuzz_redis():
    """A Redis server of the module's own."""
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fuzz_gateway(fuzz_redis):
    """A real gateway (CharTokenizer: vocabulary 300, context 128 tokens) on ``fuzz_redis``."""
    gw = start_gateway(fuzz_redis.url)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def fuzz_worker(fuzz_redis, fuzz_gateway):
    """The only worker on ``fuzz_redis``: it sees every request the gateway queues."""
    worker = FakeWorker(fuzz_redis.url, worker_id="fuzz-worker").start()
    yield worker
    worker.stop()


@pytest.fixture()
def tenants(fuzz_redis, fuzz_gateway, fuzz_worker) -> dict[str, str]:
    """Plaintext keys (after the per-test FLUSHALL): ``a`` and ``b`` (two tenants, one
    request in flight each, so a leaked slot turns the next request into a 429) and
    ``revoked`` (tenant a's, revoked). Waits for the worker's heartbeat."""
    client = redis.Redis.from_url(fuzz_redis.url)
    client.flushall()
    _, key_a = keys.create_key(client, "tenant-a", "fuzz", max_inflight=1)
    _, key_b = keys.create_key(client, "tenant-b", "fuzz", max_inflight=1)
    revoked_id, revoked = keys.create_key(client, "tenant-a", "revoked")
    keys.revoke_key(client, revoked_id)
    deadline = time.monotonic() + 3
    while not client.keys("inflight:workers:*") and time.monotonic() < deadline:
        time.sleep(0.02)
    client.close()
    fuzz_worker.check()
    return {"a": key_a, "b": key_b, "revoked": revoked}
