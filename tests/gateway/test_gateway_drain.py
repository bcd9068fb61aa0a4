"""A gateway told to stop (SIGTERM cancels ``serve``) refuses new requests but lets
open SSE and gRPC streams finish within its grace period (issue 7, graceful drain)."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
import redis

from gateway import keys
from protos import inference_pb2, inference_pb2_grpc
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import start_redis


@pytest.fixture()
def stack():
    server = start_redis()
    gw = start_gateway(server.url, grace_s=20.0)
    worker = FakeWorker(server.url, step_s=0.01).start()  # "slow": 500 pieces, ~5 s
    client = redis.Redis.from_url(server.url)
    _, key = keys.create_key(client, "t", "drain")
    client.close()
    yield gw, key
    worker.stop()
    if gw.thread.is_alive():
        gw.stop()
    server.stop()


def test_open_streams_finish_while_new_requests_are_refused(stack):
    gw, key = stack
    headers = {"Authorization": f"Bearer {key}"}
    sse: dict = {"lines": []}
    first = threading.Event()

    def read_sse():
        with httpx.stream("POST", gw.rest_url + "/v1/completions", headers=headers, timeout=30,
                          json={"prompt": "slow", "stream": True}) as r:
            for line in r.iter_lines():
                sse["lines"].append(line)
                first.set()

    reader = threading.Thread(target=read_sse)
    reader.start()
    channel = grpc.insecure_channel(gw.grpc_target)
    call = inference_pb2_grpc.InferenceStub(channel).Generate(
        inference_pb2.GenerateRequest(prompt="slow", request_id="drain-grpc"),
        metadata=(("authorization", f"Bearer {key}"),), timeout=30)
    assert next(call).text and first.wait(10)

    stopper = threading.Thread(target=gw.stop)
    stopper.start()
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):  # the listener is closed: new requests go elsewhere
        httpx.post(gw.rest_url + "/v1/completions", headers=headers, json={"prompt": "hi"}, timeout=2)

    grpc_rest = list(call)
    reader.join(30)
    assert grpc_rest[-1].finish_reason, "the gRPC stream finished"
    assert len(grpc_rest) == 500  # the rest of "slow" (500 pieces, then the finish), after the stop began
    data = [line for line in sse["lines"] if line.startswith("data: ")]
    assert data and data[-1] == "data: [DONE]" and len(data) > 500, (data[-3:], sse["lines"][:5])
    gw.thread.join(30)
    assert not gw.thread.is_alive()
    channel.close()
