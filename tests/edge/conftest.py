"""Edge fixtures: real nginx (``stack.edge.start_nginx``) on free ports in front of a
real gateway and the fake worker (the tests skip themselves when nginx is not installed)."""

from __future__ import annotations

import tempfile

import pytest
import redis

from gateway import keys
from stack.edge import EdgeSettings, start_nginx
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import free_port


@pytest.fixture(scope="module")
def gateway(redis_server):
    gw = start_gateway(redis_server.url)
    worker = FakeWorker(redis_server.url).start()
    yield gw
    worker.stop()
    gw.stop()


@pytest.fixture()
def api_key(redis_url, gateway) -> str:
    client = redis.Redis.from_url(redis_url)
    _, plaintext = keys.create_key(client, "edge-tenant", "edge")
    client.close()
    return plaintext


@pytest.fixture()
def edge(gateway):
    """A factory: ``edge(**EdgeSettings overrides)`` starts nginx in front of ``gateway``
    (fresh limit zones each time) and stops it at teardown."""
    procs = []

    def start(**overrides) -> EdgeSettings:
        values = dict(run_dir=tempfile.mkdtemp(prefix="edge-"), rest_port_edge=free_port(),
                      grpc_port_edge=free_port(), rest_port=gateway.settings.rest_port,
                      grpc_port=gateway.settings.grpc_port)
        values.update(overrides)
        settings = EdgeSettings(**values)
        procs.append(start_nginx(settings))
        return settings

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(5)
