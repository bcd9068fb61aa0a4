"""Both /metrics under load tell the truth: occupancy within bounds while it runs,
exact counts once it is over (TTFT once per request, rejections as the clients saw them)."""

from __future__ import annotations

import asyncio
import urllib.request

import httpx
import pytest

from stack.clients import rest_chat_stream
from common.promtext import sample_sum

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 12
NUM_BAD_KEY = 3


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    return sample_sum(text, name, labels)


def test_metrics_match_what_clients_saw(stack, api_key, rest_url):
    gateway_metrics = stack.endpoints()["gateway_rest"] + "/metrics"
    worker_metrics = stack.endpoints()["worker_metrics"]
    before = scrape(gateway_metrics)

    async def load():
        tasks = [asyncio.ensure_future(rest_chat_stream(rest_url, api_key, f"Tell me about the number {i}.",
                                                        max_tokens=24, extra={"ignore_eos": True}))
                 for i in range(NUM_REQUESTS)]
        async with httpx.AsyncClient(timeout=30) as client:
            bad = [await client.post(f"{rest_url}/v1/chat/completions", headers={"Authorization": "Bearer sk-nope"},
                                     json={"messages": [{"role": "user", "content": "hi"}]})
                   for _ in range(NUM_BAD_KEY)]
        samples = []
        while not all(t.done() for t in tasks):
            samples.append(await asyncio.to_thread(scrape, worker_metrics))
            await asyncio.sleep(0.1)
        return await asyncio.gather(*tasks), bad, samples

    results, bad, samples = asyncio.run(asyncio.wait_for(load(), 300))
    assert all(r.error is None and r.completion_tokens == 24 for r in results)
    assert [r.status_code for r in bad] == [401] * NUM_BAD_KEY

    for text in samples:
        running = value(text, "inflight_requests_running")
        waiting = value(text, "inflight_requests_waiting")
        assert 0.0 <= value(text, "inflight_kv_cache_usage") <= 1.0
        assert 0 <= running <= NUM_REQUESTS and 0 <= waiting <= NUM_REQUESTS
        assert running + waiting <= NUM_REQUESTS
    assert max(value(t, "inflight_requests_running") for t in samples) > 1  # it really batched

    after = scrape(gateway_metrics)
    assert value(after, "inflight_time_to_first_token_seconds_count") - \
        value(before, "inflight_time_to_first_token_seconds_count") == NUM_REQUESTS
    assert value(after, "inflight_e2e_request_latency_seconds_count") - \
        value(before, "inflight_e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert value(after, "inflight_gateway_rejections_total", {"reason": "auth"}) - \
        value(before, "inflight_gateway_rejections_total", {"reason": "auth"}) == NUM_BAD_KEY
    final = scrape(worker_metrics)
    assert value(final, "inflight_requests_running") == 0 and value(final, "inflight_requests_waiting") == 0
    assert value(after, "inflight_queue_depth") == 0
