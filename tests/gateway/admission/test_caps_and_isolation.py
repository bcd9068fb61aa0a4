"""Per-key caps are refused before anything is queued (Redis stream length unchanged, windows
untouched), and a key flooding long requests does not cost another key a single rejection."""

from __future__ import annotations

import asyncio
import threading

import grpc
import httpx
import pytest
import redis

from common.redis_keys import stream_name
from tests.gateway.fake_worker import MODEL
from gateway import keys
from gateway.admission.ratelimit import window_usage
from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.gateway.conftest import wait_for
from tests.gateway.harness import start_gateway

STREAMS = [stream_name(p, MODEL) for p in (0, 1, 2)]


def _post(url, key, body, timeout=10):
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"})


def test_key_caps_refused_before_anything_is_queued(redis_server):
    url = redis_server.url.rsplit("/", 1)[0] + "/2"  # a db no worker reads: queued entries stay
    client = redis.Redis.from_url(url)
    client.flushdb()
    gw = start_gateway(url, request_timeout_s=5.0)
    try:
        key_id, key = keys.create_key(client, "t-caps", "caps", max_max_tokens=16,
                                      max_prompt_tokens=20)
        # Sanity: an acceptable request really is queued in this db (then XDELed on disconnect).
        waiting = threading.Thread(target=lambda: pytest.raises(httpx.ReadTimeout, _post, gw.rest_url,
                                   key, {"prompt": "hi", "max_tokens": 16}, timeout=1.0))
        waiting.start()
        assert wait_for(lambda: client.xlen(stream_name(1, MODEL)) == 1)
        waiting.join()
        assert wait_for(lambda: client.xlen(stream_name(1, MODEL)) == 0)
        client.xadd(stream_name(1, MODEL), {"req": b"marker"})  # XLEN 1: must stay 1
        before = [client.xlen(s) for s in STREAMS]
        usage_before = window_usage(client, key_id)

        r = _post(gw.rest_url, key, {"prompt": "hi", "max_tokens": 17})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = _post(gw.rest_url, key, {"prompt": "x" * 21, "max_tokens": 1})
        assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
        meta = (("authorization", f"Bearer {key}"),)
        with grpc.insecure_channel(gw.grpc_target) as ch:
            stub = inference_pb2_grpc.InferenceStub(ch)
            for req in (inference_pb2.GenerateRequest(
                            prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=17)),
                        inference_pb2.GenerateRequest(
                            prompt="x" * 21, sampling=common_pb2.SamplingParams(max_tokens=1))):
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(req, metadata=meta, timeout=5))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        assert [client.xlen(s) for s in STREAMS] == before
        assert window_usage(client, key_id) == usage_before  # nothing reserved either
    finally:
        gw.stop()
        client.flushdb()


async def _flood_and_serve(url, flooder, victim):
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
        def post(key, body):
            return client.post(url + "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"})

        long_body = {"prompt": "slow " + "x" * 90, "max_tokens": 30}  # 500 pieces: long-running
        flood = [post(flooder, long_body) for _ in range(40)]
        served = [post(victim, {"prompt": "hi", "max_tokens": 3}) for _ in range(20)]
        replies = await asyncio.gather(*flood, *served)
        return replies[:40], replies[40:]


def test_flooding_key_does_not_raise_another_keys_rejections(api_key, redis_url):
    # Its own gateway with a 5 s Redis timeout: under a loaded 2-core CI machine the
    # session gateway's 0.5 s answered 503s instead of the rejections this test is about.
    gw = start_gateway(redis_url, redis_timeout_s=5.0)
    client = redis.Redis.from_url(redis_url)
    try:
        _, flooder = keys.create_key(client, "t-flood", "flood", requests_per_min=1000,
                                     tokens_per_min=1000, max_inflight=4)
        victim_id, victim = keys.create_key(client, "t-victim", "victim", requests_per_min=20,
                                            tokens_per_min=200, max_inflight=20)
        flood, served = asyncio.run(_flood_and_serve(gw.rest_url, flooder, victim))
    finally:
        gw.stop()
    other = [(r.status_code, r.text[:200]) for r in flood if r.status_code not in (200, 429)]
    codes = [r.json()["error"]["code"] for r in flood if r.status_code == 429]
    assert len(codes) >= 30 and set(codes) <= {"key_tokens", "in_flight"}, (codes, other)
    assert [r.status_code for r in served] == [200] * 20, [(r.status_code, r.text[:200]) for r in served]
    assert window_usage(client, victim_id)["requests"] == 20
