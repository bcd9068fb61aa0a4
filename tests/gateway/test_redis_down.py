"""Redis unreachable → 503 / UNAVAILABLE fast, and recovery without a restart."""

import socket
import time

import grpc
import httpx
import pytest
import redis

from gateway import keys
from protos import inference_pb2, inference_pb2_grpc
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import free_port, start_redis


@pytest.fixture()
def orphan_gateway():
    port = free_port()  # nothing listens here (yet)
    gw = start_gateway(f"redis://127.0.0.1:{port}/0")
    yield gw, port
    gw.stop()


def test_redis_down_fails_fast_then_recovers(orphan_gateway):
    gw, port = orphan_gateway
    headers = {"Authorization": "Bearer sk-inflight-whatever"}
    started = time.monotonic()
    r = httpx.post(gw.rest_url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "redis_unavailable"
    assert str(port) not in r.text and "127.0.0.1" not in r.text  # Redis's address stays in the logs
    assert httpx.get(gw.rest_url + "/ready").status_code == 503
    with grpc.insecure_channel(gw.grpc_target) as ch, pytest.raises(grpc.RpcError) as info:
        list(inference_pb2_grpc.InferenceStub(ch).Generate(
            inference_pb2.GenerateRequest(prompt="hi"), metadata=(("authorization", headers["Authorization"]),)))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 3.0

    server = start_redis(port=port)
    try:
        client = redis.Redis(port=port)
        _, key = keys.create_key(client, "t")
        r = httpx.get(gw.rest_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        client.close()
    finally:
        server.stop()


@pytest.fixture()
def hung_redis_gateway():
    """A gateway whose Redis accepts connections and never answers (a stopped or cut-off
    server): the kernel completes the handshake on a listening socket nobody reads."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    gw = start_gateway(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", redis_timeout_s=1.0)
    yield gw
    gw.stop()
    listener.close()


def test_a_hung_redis_gets_a_503_after_one_timeout_not_two(hung_redis_gateway):
    """A timed-out command is not retried (only a closed connection is), so the client
    waits ``redis_timeout_s`` (1 s here) for its 503, not twice that."""
    started = time.monotonic()
    r = httpx.post(hung_redis_gateway.rest_url + "/v1/completions", json={"prompt": "hi"},
                   headers={"Authorization": "Bearer sk-inflight-whatever"}, timeout=30)
    elapsed = time.monotonic() - started
    assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable"
    assert 1.0 <= elapsed < 1.9, f"503 after {elapsed:.2f} s"
