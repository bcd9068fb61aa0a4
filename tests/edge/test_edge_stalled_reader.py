"""A client that stops reading a stream behind nginx (issue 49): the chaos soak found that its
output went into the socket buffers between the gateway and nginx and between nginx and the
client, which autotune to megabytes on loopback, so the gateway's send never blocked, its
``--stream-idle-timeout`` never fired and the sequence generated to ``max_tokens`` for nobody.
With the gateway's and the edge's send buffers bounded, the send blocks after a few hundred KB
and the stream is cancelled (the worker told) while the request is still generating."""

from __future__ import annotations

import json
import socket
import tempfile

import redis

from gateway import keys
from stack.edge import EdgeSettings, start_nginx
from tests.gateway.fake_tokenizer import CharTokenizer
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import free_port, start_redis
from tests.gateway.conftest import wait_for

PIECES = 1000  # 4,000 characters each (the fake worker's flood): 4 MB of output, 10 s or more to generate


def _stalled_reader_is_cancelled(gateway_idle_s: float, edge_send_timeout_s: int) -> None:
    """A client behind nginx asks for ``PIECES`` (4 MB), reads once and never again without
    closing; asserts the worker is told to cancel before it finished generating."""
    server = start_redis()
    worker = FakeWorker(server.url, worker_id="steady-1", step_s=0.01).start()  # 10 s to generate it all
    gateway = start_gateway(server.url, tokenizer=CharTokenizer(context_length=4096),
                            stream_idle_timeout_s=gateway_idle_s, stream_buffer_events=10**9)
    settings = EdgeSettings(run_dir=tempfile.mkdtemp(prefix="edge-"), rest_port_edge=free_port(),
                            grpc_port_edge=free_port(), rest_port=gateway.settings.rest_port,
                            grpc_port=gateway.settings.grpc_port, client_send_timeout_s=edge_send_timeout_s)
    nginx = start_nginx(settings)
    sock = socket.socket()
    try:
        client = redis.Redis.from_url(server.url)
        _, api_key = keys.create_key(client, "tenant-a", "stalled")
        client.close()
        body = json.dumps({"model": "test-model", "prompt": "flood", "max_tokens": PIECES, "stream": True}).encode()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.connect(("127.0.0.1", settings.rest_port_edge))
        seen = len(worker.accepted)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: len(worker.accepted) > seen, 20)
        rid = worker.accepted[-1]
        sock.recv(4096)  # one read, then never again (without closing)
        assert wait_for(lambda: rid in worker.cancels or rid in worker.finished, 60)
        assert rid in worker.cancels, "the stalled stream ran to max_tokens: nobody cancelled it"
    finally:
        sock.close()
        nginx.terminate()
        nginx.wait(5)
        gateway.stop()
        worker.stop()
        server.stop()


def test_a_stalled_reader_behind_nginx_is_cancelled_while_its_request_still_generates():
    """The gateway's own bound (``--stream-idle-timeout`` 1 s), the edge's out of reach."""
    _stalled_reader_is_cancelled(gateway_idle_s=1.0, edge_send_timeout_s=600)


def test_the_edge_closes_a_client_that_takes_nothing_and_the_request_is_cancelled():
    """The edge's own bound (nginx ``send_timeout``, ``EdgeSettings.client_send_timeout_s``): with
    the gateway's idle timeout out of reach (600 s), a client that stops reading is closed by nginx
    after 1 s of no progress and its gateway cancels the request while it still generates. The
    chaos soak's 30-minute run saw streams fit the autotuned loopback buffers between nginx and
    the gateway, so no gateway send blocked and only nginx could tell."""
    _stalled_reader_is_cancelled(gateway_idle_s=600.0, edge_send_timeout_s=1)


def test_the_rest_socket_and_the_edge_bound_what_a_stalled_reader_can_take():
    """What the test above relies on, without timing: every connection the gateway accepts
    inherits the listening socket's bounded send buffer (Linux reports twice the set value),
    and the edge's REST listener bounds its own (nginx ``listen ... sndbuf``)."""
    from pathlib import Path

    from gateway.main import REST_SEND_BUFFER_BYTES, _rest_socket

    listener = _rest_socket("127.0.0.1", 0)
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 2 * REST_SEND_BUFFER_BYTES
    finally:
        for s in (accepted, client, listener):
            s.close()
    template = (Path(__file__).resolve().parents[2] / "nginx" / "nginx.conf.template").read_text()
    assert "${rest_port_edge}${rest_listen_tls} sndbuf=64k;" in template
    assert "send_timeout ${client_send_timeout_s}s;" in template
