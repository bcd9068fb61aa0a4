"""REST front against a real gateway, a private Redis and the fake worker."""

import json

import httpx
import pytest

from common.promtext import sample_sum
from tests.gateway.conftest import wait_for
from tests.gateway.fake_worker import MODEL
from tests.helpers.sse import sse_events


def post(gateway, path, body, key=None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gateway.rest_url + path, json=body, headers=headers, timeout=10, **kw)


def test_health_ready_models_metrics(gateway, api_key):
    assert httpx.get(gateway.rest_url + "/health").json() == {"status": "ok"}
    assert httpx.get(gateway.rest_url + "/ready").status_code == 200
    models = httpx.get(gateway.rest_url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    assert models.json()["data"][0]["id"] == "test-model"
    one = httpx.get(gateway.rest_url + "/v1/models/test-model", headers={"Authorization": f"Bearer {api_key}"})
    assert one.status_code == 200 and one.json()["id"] == "test-model"  # openai's models.retrieve()
    other = httpx.get(gateway.rest_url + "/v1/models/gpt-4", headers={"Authorization": f"Bearer {api_key}"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    text = httpx.get(gateway.rest_url + "/metrics").text
    assert "inflight_gateway_requests_total" in text and "inflight_time_to_first_token_seconds" in text


@pytest.mark.parametrize("header", [None, "Bearer sk-inflight-wrong", "Basic xyz"])
def test_auth_failures_are_401(gateway, api_key, header):
    headers = {"Authorization": header} if header else {}
    r = httpx.post(gateway.rest_url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"


def test_revoked_key_is_401(gateway, api_key, redis_url):
    import redis

    from gateway import keys
    client = redis.Redis.from_url(redis_url)
    keys.revoke_key(client, keys.list_keys(client)[0].key_id)
    r = post(gateway, "/v1/completions", {"prompt": "hi"}, api_key)
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]


@pytest.mark.parametrize("extra,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 301}, "top_k"), ({"max_tokens": 200}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"n": 17}, "n"), ({"n": 0}, "n"),
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 21}, "logprobs"),  # completions' own name, not chat's
    ({"logprobs": 50}, "logprobs"),  # past vLLM's default --max-logprobs (20): its 400 too
])
def test_validation_is_400_with_param(gateway, api_key, extra, param):
    r = post(gateway, "/v1/completions", {"prompt": "hello", **extra}, api_key)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_nan_and_inf_temperature_are_400(gateway, api_key, value):
    body = '{"prompt": "hello", "temperature": %s}' % value
    r = httpx.post(gateway.rest_url + "/v1/completions", content=body,
                   headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_bad_json_is_400(gateway, api_key):
    r = httpx.post(gateway.rest_url + "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_json_without_its_content_type_is_400_that_says_so(gateway, api_key, content_type):
    """``curl -d '{...}'`` sends form encoding: the 400 names the header to set."""
    headers = {"Authorization": f"Bearer {api_key}"} | ({"Content-Type": content_type} if content_type else {})
    r = httpx.post(gateway.rest_url + "/v1/completions", content=b'{"prompt": "hello"}', headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_too_long_then_next_request_succeeds(gateway, api_key):
    r = post(gateway, "/v1/completions", {"prompt": "x" * 100, "max_tokens": 50}, api_key)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = post(gateway, "/v1/completions", {"prompt": "hello", "max_tokens": 3}, api_key)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "w0 w1 w2 " and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_null_max_tokens_takes_default(gateway, api_key, fake_worker):
    r = post(gateway, "/v1/completions", {"prompt": "hello", "max_tokens": None}, api_key)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    assert fake_worker.requests[-1].sampling.max_tokens == 128 - 5
    assert fake_worker.requests[-1].reply_to == gateway.settings.reply_to


def test_chat_stream_sse_ends_with_done_and_usage(gateway, api_key):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2,
            "stream_options": {"include_usage": True}}
    r = post(gateway, "/v1/chat/completions", body, api_key)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    frames = ["data: " + e["data"] for e in events]
    assert all("data" in e for e in events) and frames[-1] == "data: [DONE]"
    assert all(e["id"].startswith(r.headers["x-request-id"] + "/") for e in events[:-1])  # resumable
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "w0 w1 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def _requests_counted(gateway, endpoint: str, status: int, model_name: str | None = None) -> float:
    labels = {"endpoint": endpoint, "status": str(status)}
    if model_name is not None:
        labels["model_name"] = model_name
    return sample_sum(httpx.get(gateway.rest_url + "/metrics").text, "inflight_gateway_requests_total", labels)


def test_requests_are_counted_by_route_status_and_model(gateway, api_key):
    """The served model's id once admission resolved it; "" for a request refused before (a
    bad key, an unknown model: never the name a client sent)."""
    chat = "/v1/chat/completions"
    before = {(s, m): _requests_counted(gateway, chat, s, m) for s, m in ((200, MODEL), (401, ""), (404, ""))}
    stream = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2}
    assert post(gateway, chat, stream, api_key).status_code == 200
    assert post(gateway, chat, stream, "sk-inflight-nope").status_code == 401
    assert post(gateway, chat, {**stream, "model": "no-such-model"}, api_key).status_code == 404
    assert _requests_counted(gateway, chat, 200, MODEL) == before[(200, MODEL)] + 1
    assert _requests_counted(gateway, chat, 401, "") == before[(401, "")] + 1
    assert _requests_counted(gateway, chat, 404, "") == before[(404, "")] + 1
    assert "no-such-model" not in httpx.get(gateway.rest_url + "/metrics").text
    unknown = _requests_counted(gateway, "unknown", 404)
    assert httpx.get(gateway.rest_url + "/v2/nothing").status_code == 404
    assert _requests_counted(gateway, "unknown", 404) == unknown + 1


def test_worker_error_is_500(gateway, api_key):
    r = post(gateway, "/v1/completions", {"prompt": "please fail"}, api_key)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_stream_disconnect_sends_cancel(gateway, api_key, fake_worker):
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.stream("POST", gateway.rest_url + "/v1/completions", headers=headers,
                      json={"prompt": "slow", "stream": True}, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                rid = "req-" + json.loads(line[6:])["id"].split("req-")[1]
                break
    assert wait_for(lambda: rid in fake_worker.cancels), "no Cancel reached the worker"


def test_nonstream_disconnect_sends_cancel(gateway, api_key, fake_worker):
    before = len(fake_worker.accepted)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway.rest_url + "/v1/chat/completions", timeout=0.5,
                   headers={"Authorization": f"Bearer {api_key}"},
                   json={"messages": [{"role": "user", "content": "slow"}]})
    assert wait_for(lambda: len(fake_worker.accepted) > before)
    rid = fake_worker.accepted[-1]
    assert wait_for(lambda: rid in fake_worker.cancels), "no Cancel reached the worker"


def test_streaming_responses_carry_the_request_id(gateway, api_key):
    with httpx.stream("POST", gateway.rest_url + "/v1/completions", timeout=10,
                      headers={"Authorization": f"Bearer {api_key}"},
                      json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        body = "".join(r.iter_text())
        request_id = r.headers.get("x-request-id")
    assert r.status_code == 200 and request_id
    assert f'"id":"{request_id}"' in body.replace(" ", "") or request_id in body

