"""The worker's two health surfaces follow one HealthState: HTTP /ready and the
grpc.health.v1 service (real servers on loopback, no model)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client import CollectorRegistry

from tests.helpers.redis_server import free_port
from worker.serve.health_grpc import NOT_SERVING, SERVING, start_grpc_health_server
from worker.serve.health_http import HealthState, start_health_server


def http_ready(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def servers():
    state = HealthState()
    grpc_server = start_grpc_health_server("127.0.0.1", free_port())
    state.on_change(grpc_server.set_serving)
    http = start_health_server("127.0.0.1", free_port(), state, CollectorRegistry())
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    stub = health_pb2_grpc.HealthStub(channel)
    yield state, stub, http.server_address[1], channel
    channel.close()
    http.shutdown()
    http.server_close()
    grpc_server.stop(0)


def check(stub) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_not_serving_until_ready_then_serving_then_not_serving_on_drain(servers):
    state, stub, http_port, _ = servers
    assert check(stub) == NOT_SERVING and http_ready(http_port) == 503
    state.mark_ready()
    assert check(stub) == SERVING and http_ready(http_port) == 200
    state.start_drain()
    assert check(stub) == NOT_SERVING and http_ready(http_port) == 503
    state.mark_ready()  # a drain is for good
    assert check(stub) == NOT_SERVING and http_ready(http_port) == 503


def test_unknown_service_is_not_found_and_reflection_lists_health(servers):
    _, stub, _, channel = servers
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)


def test_stop_turns_not_serving_for_good():
    server = start_grpc_health_server("127.0.0.1", free_port())
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        server.set_serving(True)
        assert check(stub) == SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == SERVING
        server.stop(grace_s=2)
        assert next(watch).status == NOT_SERVING  # sent to watchers before the server goes
    server.set_serving(True)  # ignored after stop; must not raise


def test_port_taken_raises_oserror():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(OSError):
            start_grpc_health_server("127.0.0.1", sock.getsockname()[1])


def test_a_second_worker_on_the_same_port_fails():
    first = start_grpc_health_server("127.0.0.1", free_port())
    try:
        with pytest.raises(OSError):
            start_grpc_health_server("127.0.0.1", first.port)
    finally:
        first.stop(0)
