"""OpenAI's ``x-ratelimit-*`` headers (REST) and initial metadata (gRPC), from the admission
script's own view of the key's windows."""

import grpc
import httpx
import pytest
import redis

from gateway import keys
from gateway.admission.ratelimit import RateLimitState, openai_duration
from protos import common_pb2, inference_pb2, inference_pb2_grpc

NAMES = {f"x-ratelimit-{what}-{unit}" for what in ("limit", "remaining", "reset")
         for unit in ("requests", "tokens")}


@pytest.mark.parametrize("seconds,text", [
    (0, "0s"), (0.0004, "0s"), (0.02, "20ms"), (0.9994, "999ms"), (1, "1s"), (1.5, "1.5s"),
    (59.999, "59.999s"), (60, "1m0s"), (360, "6m0s"), (61.25, "1m1.25s"), (3600, "1h0m0s"),
    (3723.5, "1h2m3.5s"), (-3, "0s"),
])
def test_openai_duration_format(seconds, text):
    assert openai_duration(seconds) == text


def test_headers_only_for_the_limits_a_key_has():
    assert RateLimitState(0, 0, 0, 0, 0, 0).headers() == {}
    assert RateLimitState(60, 59, 60, 0, 0, 0).headers() == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1m0s"}


def _key(redis_url, **limits):
    client = redis.Redis.from_url(redis_url)
    _, key = keys.create_key(client, "tenant-rl", "headers", **limits)
    client.close()
    return key


def _post(gateway, key, body):
    return httpx.post(gateway.rest_url + "/v1/completions", json=body, timeout=10,
                      headers={"Authorization": f"Bearer {key}"})


def test_rest_headers_count_down_and_come_with_the_429(gateway, api_key, redis_url):
    key = _key(redis_url, requests_per_min=3, tokens_per_min=100)
    body = {"prompt": "hello", "max_tokens": 5}  # costs 10 tokens
    replies = [_post(gateway, key, body) for _ in range(3)]
    replies.append(_post(gateway, key, {**body, "stream": True}))
    assert [r.status_code for r in replies] == [200, 200, 200, 429]
    for r in replies:
        assert NAMES <= set(r.headers), r.headers
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert r.headers["x-ratelimit-limit-tokens"] == "100"
    assert [r.headers["x-ratelimit-remaining-requests"] for r in replies] == ["2", "1", "0", "0"]
    # the fake worker generates all 5 tokens: nothing refunded, 10 tokens per request
    assert [r.headers["x-ratelimit-remaining-tokens"] for r in replies] == ["90", "80", "70", "70"]
    assert replies[0].headers["x-ratelimit-reset-requests"] == "1m0s"
    reset = replies[3].headers["x-ratelimit-reset-requests"]  # the window's newest entry
    assert reset.endswith("s") and reset not in ("0s",)
    assert replies[3].json()["error"]["code"] == "key_rate" and replies[3].headers["retry-after"]


def test_streamed_response_carries_them(gateway, api_key, redis_url):
    key = _key(redis_url, tokens_per_min=1000)
    r = _post(gateway, key, {"prompt": "hello", "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == "993"
    assert "x-ratelimit-limit-requests" not in r.headers  # no requests/min limit


def test_no_headers_for_a_key_without_limits(gateway, api_key):
    r = _post(gateway, api_key, {"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200 and not NAMES & set(r.headers)


def test_grpc_initial_metadata(gateway, api_key, redis_url):
    key = _key(redis_url, requests_per_min=1, tokens_per_min=50)
    auth = (("authorization", f"Bearer {key}"),)
    request = inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2))
    with grpc.insecure_channel(gateway.grpc_target) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        call = stub.Generate(request, metadata=auth, timeout=10)
        list(call)
        first = dict(call.initial_metadata())
        refused = stub.Generate(request, metadata=auth, timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            list(refused)
        second = dict(info.value.initial_metadata())
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (first["x-ratelimit-limit-requests"], first["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert (first["x-ratelimit-limit-tokens"], first["x-ratelimit-remaining-tokens"]) == ("50", "46")
    assert first["x-ratelimit-reset-requests"] == "1m0s"
    assert second["x-ratelimit-remaining-requests"] == "0" and second["x-ratelimit-remaining-tokens"] == "46"
