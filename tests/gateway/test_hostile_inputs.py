"""Inputs a new user found that crashed or were coerced: each is a clear 400 now,
and none of them holds an admission slot afterwards."""

from __future__ import annotations

import httpx
import pytest
import redis

from gateway import keys


def chat(gateway, key, raw: str):
    return httpx.post(gateway.rest_url + "/v1/chat/completions", content=raw.encode("utf-8"), timeout=10,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


MSG = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("raw,param", [
    ('{%s, "seed": 99999999999999999999999}' % MSG, "seed"),
    ('{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}', "messages"),
    ('{%s, "max_tokens": "10"}' % MSG, "max_tokens"),
    ('{%s, "max_tokens": 10.0}' % MSG, "max_tokens"),
    ('{%s, "max_tokens": true}' % MSG, "max_tokens"),
    ('{%s, "temperature": "0.5"}' % MSG, "temperature"),
    ('{%s, "stream": "yes"}' % MSG, "stream"),
])
def test_bad_values_are_400_and_hold_no_slot(gateway, redis_url, fake_worker, raw, param):
    client = redis.Redis.from_url(redis_url)
    _, key = keys.create_key(client, "hostile", max_inflight=1)
    for _ in range(3):  # a leaked in-flight slot would turn the 2nd and 3rd into 429
        r = chat(gateway, key, raw)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    ok = chat(gateway, key, '{%s, "max_tokens": 3}' % MSG)
    assert ok.status_code == 200, ok.text
    client.close()


@pytest.mark.parametrize("raw,param,words", [
    ('{%s, "stop": [1, 2]}' % MSG, "stop", "accepted: str, list[str]"),  # not pydantic's "stop.str"
    ('', None, "the request body is empty"),
    ('[1, 2, 3]', None, "the request body must be a JSON object"),
])
def test_body_shape_errors_name_what_the_client_sent(gateway, api_key, raw, param, words):
    r = chat(gateway, api_key, raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
