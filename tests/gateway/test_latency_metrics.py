"""TTFT once per request, inter-token latency per later token, queue depth per priority."""

from __future__ import annotations

import json

import httpx

from common.promtext import sample_sum
from common.redis_keys import stream_name
from tests.gateway.fake_worker import MODEL
from protos import queue_pb2


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    return sample_sum(text, name, labels)


def scrape(gateway) -> str:
    return httpx.get(gateway.rest_url + "/metrics", timeout=5).text


def test_ttft_once_and_itl_per_later_token(gateway, api_key):
    before = scrape(gateway)
    r = httpx.post(gateway.rest_url + "/v1/completions", timeout=10, headers={"Authorization": f"Bearer {api_key}"},
                   json={"prompt": "hello", "max_tokens": 5, "stream": True,
                         "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and "[DONE]" in r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    completion_tokens = next(c["usage"]["completion_tokens"] for c in chunks if c.get("usage"))
    after = scrape(gateway)
    ttft = "inflight_time_to_first_token_seconds_count"
    itl = "inflight_inter_token_latency_seconds_count"
    assert metric(after, ttft) - metric(before, ttft) == 1
    assert completion_tokens > 1
    assert metric(after, itl) - metric(before, itl) == completion_tokens - 1
    # each carries the served model's id (model_name, vLLM's label), as do the token counters
    served = {"model_name": MODEL}
    assert metric(after, ttft, served) - metric(before, ttft, served) == 1
    assert metric(after, itl, served) - metric(before, itl, served) == completion_tokens - 1
    generated = "inflight_gateway_generation_tokens_total"
    assert metric(after, generated, served) - metric(before, generated, served) == completion_tokens
    assert metric(after, "inflight_e2e_request_latency_seconds_count", served) >= 1


def test_queue_depth_is_read_from_redis(redis_server):
    """XLEN per priority stream, in a database no (fake) worker reads."""
    import asyncio

    import redis.asyncio as aioredis

    from gateway.service import GatewayService
    from gateway.settings import GatewaySettings
    from tests.gateway.fake_tokenizer import CharTokenizer

    async def scenario():
        url = redis_server.url.rsplit("/", 1)[0] + "/5"
        client = aioredis.Redis.from_url(url)
        await client.flushdb()
        for _ in range(3):
            await client.xadd(stream_name(2, MODEL), {"req": queue_pb2.QueuedRequest().SerializeToString()})
        await client.xadd(stream_name(0, MODEL), {"req": b""})
        service = GatewayService(GatewaySettings(redis_url=url, served_model_name=MODEL), client,
                                 tokenizer=CharTokenizer())
        await service.refresh_queue_depth()
        text = service.metrics.render().decode()
        await client.flushdb()
        await client.aclose()
        return text

    text = asyncio.run(scenario())
    assert metric(text, "inflight_queue_depth", {"model_name": MODEL, "priority": "0"}) == 1
    assert metric(text, "inflight_queue_depth", {"model_name": MODEL, "priority": "1"}) == 0
    assert metric(text, "inflight_queue_depth", {"model_name": MODEL, "priority": "2"}) == 3


def test_waiting_clients_counts_open_requests(gateway, api_key):
    """inflight_gateway_waiting_clients is set at scrape time from the request table."""
    import grpc

    from protos import inference_pb2, inference_pb2_grpc

    before = metric(scrape(gateway), "inflight_gateway_waiting_clients")
    with grpc.insecure_channel(gateway.grpc_target) as ch:
        call = inference_pb2_grpc.InferenceStub(ch).Generate(
            inference_pb2.GenerateRequest(prompt="slow"), metadata=(("authorization", f"Bearer {api_key}"),))
        next(call)
        assert metric(scrape(gateway), "inflight_gateway_waiting_clients") == before + 1
        call.cancel()
