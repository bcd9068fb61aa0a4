"""``rediss://``: the gateway and the worker reach a Redis that speaks TLS only, and a
request is served through it (issue 25 item 3). A private redis-server with a TLS port
and no plain port, a self-signed certificate made with the ``openssl`` command."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import redis

from gateway import keys
from gateway.main import redis_client as gateway_redis_client
from gateway.settings import GatewaySettings
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import free_port, redis_server_binary
from worker.serve.main import redis_client as worker_redis_client

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command")


def _certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "redis.crt", folder / "redis.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def tls_redis():
    """(rediss URL trusting the server's certificate, plain URL of the same port)."""
    folder = Path(tempfile.mkdtemp(prefix="inflight-redis-tls-"))
    cert, key = _certificate(folder)
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.skip(f"this redis-server has no TLS: {proc.stdout.read().decode()[-300:]}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url, f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(5)
        shutil.rmtree(folder, ignore_errors=True)


def test_gateway_and_worker_clients_speak_tls_and_plain_text_is_refused(tls_redis):
    url, plain = tls_redis

    async def ping_both() -> tuple[bool, bool]:
        gateway = gateway_redis_client(GatewaySettings(redis_url=url))
        worker = worker_redis_client(url)
        try:
            return await gateway.ping(), await worker.ping()
        finally:
            await gateway.aclose()
            await worker.aclose()

    assert asyncio.run(ping_both()) == (True, True)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, socket_connect_timeout=1, socket_timeout=1).ping()
    untrusting = url.split("?")[0]  # TLS, but without the server's certificate as a root
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(untrusting, socket_connect_timeout=2, socket_timeout=2).ping()


def test_a_request_is_served_over_rediss(tls_redis):
    url, _ = tls_redis
    client = redis.Redis.from_url(url)
    client.flushall()
    gateway = start_gateway(url)
    worker = FakeWorker(url).start()
    try:
        _, key = keys.create_key(client, "tls-tenant", "tls")
        deadline = time.monotonic() + 5
        while not client.keys("inflight:workers:*") and time.monotonic() < deadline:
            time.sleep(0.05)
        reply = httpx.post(gateway.rest_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3},
                           headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert reply.json()["id"].removeprefix("cmpl-") in worker.finished
    finally:
        worker.stop()
        gateway.stop()
        client.close()
