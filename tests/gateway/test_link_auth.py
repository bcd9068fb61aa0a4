"""The worker link's authentication and the binding of a request to the link session
that accepted it (docs/SECURITY.md, "Attacks the tests try").

A rogue link client that knows a live request id (it sniffed a queue entry, or guessed
one) tries to end or feed that request: without the secret it is refused with
UNAUTHENTICATED; with it (a buggy or compromised worker) its output for a request
another session runs is dropped and counted. Either way the real stream is untouched.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time

import grpc
import httpx
import pytest
import redis

from common.credentials import link_secret, write_secret_file
from gateway import keys
from gateway.link_server import LinkService, LinkSession, add_link_service
from gateway.request_table import RequestTable
from protos import common_pb2, link_pb2, link_pb2_grpc
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import free_port, start_redis
from worker.serve.link_client import GatewayLink

SECRET = "test-link-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def secured():
    """A gateway with a link secret, a slow fake worker that knows it, their own Redis."""
    server = start_redis()
    gw = start_gateway(server.url, link_secret=SECRET)
    worker = FakeWorker(server.url, worker_id="honest", step_s=0.25, link_secret=SECRET).start()
    client = redis.Redis.from_url(server.url)
    _, key = keys.create_key(client, "tenant-a", "test")
    client.close()
    yield gw, worker, key
    worker.stop()
    gw.stop()
    server.stop()


def _complete_in_background(gw, key: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def call() -> None:
        resp = httpx.post(f"{gw.rest_url}/v1/completions", timeout=30,
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "test-model", "prompt": "hello", "max_tokens": 5})
        out["status"], out["body"] = resp.status_code, resp.json()

    thread = threading.Thread(target=call)
    thread.start()
    return thread, out


def _live_request_id(worker: FakeWorker, before: int) -> str:
    deadline = time.monotonic() + 5
    while len(worker.acked) <= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(worker.acked) > before, "the honest worker never got its Ack"
    return worker.acked[-1]


def _rogue_messages(rid: str, pulled: list):
    """What a rogue sends: Hello, an Accepted for the live id, a delta and a Finished for it."""
    for message in (
            link_pb2.WorkerMessage(hello=link_pb2.Hello(worker_id="rogue", model="fake")),
            link_pb2.WorkerMessage(accepted=link_pb2.Accepted(request_id=rid, worker_id="rogue")),
            link_pb2.WorkerMessage(step=link_pb2.StepOutput(
                deltas=[link_pb2.Delta(request_id=rid, text="PWNED ", token_ids=[80])],
                finished=[link_pb2.Finished(request_id=rid, finish_reason=common_pb2.FINISH_REASON_STOP,
                                            usage=common_pb2.Usage(completion_tokens=1))]))):
        pulled.append(message.WhichOneof("kind"))
        yield message
    time.sleep(1.0)  # keep the stream open while the gateway handles the above


def _rejections(gw, reason: str) -> float:
    text = httpx.get(f"{gw.rest_url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f'inflight_gateway_link_rejections_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def _assert_untouched(out: dict) -> None:
    assert out["status"] == 200, out
    choice = out["body"]["choices"][0]
    assert choice["text"] == "w0 w1 w2 w3 w4 "
    assert choice["finish_reason"] == "length"
    assert out["body"]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("offered", [None, "wrong-secret", SECRET[:-1]])
def test_a_rogue_without_the_secret_is_refused_and_the_real_stream_is_untouched(secured, offered):
    gw, worker, key = secured
    refused_before = _rejections(gw, "unauthenticated")
    thread, out = _complete_in_background(gw, key)
    rid = _live_request_id(worker, len(worker.acked))
    pulled: list = []
    metadata = (("x-inflight-link-secret", offered),) if offered else None
    with grpc.insecure_channel(gw.settings.link_host + f":{gw.settings.link_port}") as channel:
        call = link_pb2_grpc.LinkStub(channel).Connect(_rogue_messages(rid, pulled), metadata=metadata)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    thread.join(30)
    _assert_untouched(out)
    assert _rejections(gw, "unauthenticated") == refused_before + 1


def test_output_from_another_authenticated_session_is_dropped_and_counted(secured):
    """A worker that has the secret but did not accept the request (a stale or compromised
    one) cannot feed, finish or take over a request that another session accepted."""
    gw, worker, key = secured
    foreign_before = _rejections(gw, "foreign_request")
    thread, out = _complete_in_background(gw, key)
    rid = _live_request_id(worker, len(worker.acked))
    pulled: list = []
    with grpc.insecure_channel(f"127.0.0.1:{gw.settings.link_port}") as channel:
        call = link_pb2_grpc.LinkStub(channel).Connect(
            _rogue_messages(rid, pulled), metadata=(("x-inflight-link-secret", SECRET),))
        answers = [m for m in call]  # the stream ends when the rogue's requests end
    # Its Accepted for a request already running elsewhere: Ack then Cancel, not ownership.
    assert [m.WhichOneof("kind") for m in answers] == ["ack", "cancel"]
    thread.join(30)
    _assert_untouched(out)
    assert _rejections(gw, "foreign_request") == foreign_before + 2  # the delta and the Finished


def test_a_delta_before_any_accepted_is_dropped():
    """A delta for a queued request (no session accepted it yet) is refused from a link;
    a Finished is not (a worker drops an expired or invalid entry at pull)."""
    async def remove(_ticket):
        return True

    table = RequestTable(remove)
    pending = table.register("r1")
    session = LinkSession("peer")
    assert not table.deliver(link_pb2.Delta(request_id="r1", text="x", token_ids=[1]), session)
    assert pending.events.empty()
    assert table.finish(link_pb2.Finished(request_id="r1"), session)


def test_the_real_link_client_authenticates_and_a_wrong_secret_is_lost():
    async def run() -> tuple[str, list, list]:
        async def remove(_ticket):
            return True

        server = grpc.aio.server()
        service = add_link_service(server, RequestTable(remove), secret=SECRET)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        hello = link_pb2.Hello(worker_id="w-good", model="m")
        good_lost, bad_lost = [], []
        good = GatewayLink(f"127.0.0.1:{port}", hello, lambda _r: None, good_lost.append, secret=SECRET)
        bad = GatewayLink(f"127.0.0.1:{port}", link_pb2.Hello(worker_id="w-bad"), lambda _r: None,
                          bad_lost.append, secret="nope")
        await good.open()
        await bad.open()
        deadline = time.monotonic() + 5
        while (not bad_lost or not any(s.worker_id for s in service.sessions)) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        ids = sorted(s.worker_id for s in service.sessions)
        good_lost, bad_lost = list(good_lost), list(bad_lost)
        await good.close()
        await bad.close()
        await server.stop(0)
        return ids, good_lost, bad_lost

    ids, good_lost, bad_lost = asyncio.run(run())
    assert ids == ["w-good"]
    assert bad_lost and not good_lost


def test_no_secret_keeps_links_open_but_warns(caplog):
    async def remove(_ticket):
        return True

    async def build():
        return add_link_service(grpc.aio.server(), RequestTable(remove), secret=None)

    with caplog.at_level(logging.WARNING, logger="gateway.link_server"):
        service = asyncio.run(build())
    assert isinstance(service, LinkService)
    assert "no link secret configured" in caplog.text


def test_secret_sources_and_the_generated_file(tmp_path):
    path = tmp_path / "link.secret"
    value = write_secret_file(path)
    assert len(value) == 64 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    other = tmp_path / "other"
    other.write_text("from-env-file\n")
    assert link_secret(str(path), {"INFLIGHT_LINK_SECRET_FILE": str(other)}) == value
    assert link_secret(None, {"INFLIGHT_LINK_SECRET_FILE": str(other), "INFLIGHT_LINK_SECRET": "x"}) \
        == "from-env-file"
    assert link_secret(None, {"INFLIGHT_LINK_SECRET": " plain \n"}) == "plain"
    assert link_secret(None, {}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError):
        link_secret(str(tmp_path / "empty"), {})
