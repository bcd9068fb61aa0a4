"""Redis unreachable → 503 / UNAVAILABLE fast, and recovery without a restart."""

import socket
import threading
import time

import grpc
import httpx
import pytest
import redis

from gateway import keys
from protos import inference_pb2, inference_pb2_grpc
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import free_port, start_redis


# Long, so "fails fast" means "waited for no timeout" with seconds of slack for a loaded machine.
ORPHAN_TIMEOUT_S = 10.0


@pytest.fixture()
def orphan_gateway():
    port = free_port()  # nothing listens here (yet)
    gw = start_gateway(f"redis://127.0.0.1:{port}/0", redis_timeout_s=ORPHAN_TIMEOUT_S)
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
    elapsed = time.monotonic() - started
    assert elapsed < ORPHAN_TIMEOUT_S, f"{elapsed:.1f} s: a refused connection waited for the Redis timeout"

    server = start_redis(port=port)
    try:
        client = redis.Redis(port=port)
        _, key = keys.create_key(client, "t")
        r = httpx.get(gw.rest_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
        client.close()
    finally:
        server.stop()


class _HungRedis:
    """A Redis that accepts connections, reads what it is sent and never answers (a
    stopped or cut-off server), keeping each connection's bytes in ``received``."""

    def __init__(self):
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.received: list[bytearray] = []
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            self._sockets.append(conn)
            buf = bytearray()
            self.received.append(buf)
            threading.Thread(target=self._read, args=(conn, buf), daemon=True).start()

    @staticmethod
    def _read(conn: socket.socket, buf: bytearray) -> None:
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            buf.extend(data)

    def close(self) -> None:
        self.listener.close()
        for conn in self._sockets:
            conn.close()


@pytest.fixture()
def hung_redis_gateway():
    """A gateway whose Redis (:class:`_HungRedis`) accepts connections and never answers."""
    hung = _HungRedis()
    gw = start_gateway(f"redis://127.0.0.1:{hung.port}/0", redis_timeout_s=1.0)
    yield gw, hung
    gw.stop()
    hung.close()


def test_a_hung_redis_gets_a_503_after_one_timeout_not_two(hung_redis_gateway):
    """A timed-out command is not retried (only a closed connection is), so the client
    waits one ``redis_timeout_s`` (1 s here) for its 503, not twice that: the request opens
    one connection and sends its first command once (a retry opens a second and sends it
    again). Counted on the wire, not timed against an upper bound a loaded machine breaks;
    the lower bound (the timeout did elapse) no load can break."""
    gw, hung = hung_redis_gateway
    opened = len(hung.received)
    started = time.monotonic()
    r = httpx.post(gw.rest_url + "/v1/completions", json={"prompt": "hi"},
                   headers={"Authorization": "Bearer sk-inflight-whatever"}, timeout=30)
    elapsed = time.monotonic() - started
    assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable"
    assert elapsed >= 1.0, f"503 after {elapsed:.2f} s, before the timeout"
    sent = [bytes(b) for b in hung.received[opened:]]
    # one connection with a command on it (the handshake's HELLO); a retry reconnects
    assert len(sent) == 1 and sent[0].startswith(b"*"), sent
