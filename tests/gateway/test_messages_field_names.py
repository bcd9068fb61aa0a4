"""``/v1/messages`` errors name Anthropic's fields, not those of the chat path beneath it
(``gateway.rest.anthropic_format.anthropic_field_names``): real gateway and Redis."""

from __future__ import annotations

import httpx
import pytest

BASE = {"model": "test-model", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
OBJECT = {"type": "object"}


@pytest.mark.parametrize("extra, named, not_named", [
    ({"stop_sequences": ["x"] * 100}, "'stop_sequences'", "'stop'"),
    ({"stop_sequences": [""]}, "'stop_sequences'", "'stop'"),
    ({"tools": [{"name": "", "input_schema": OBJECT}]}, "tools[0].name", ".function"),
    ({"tools": [{"name": "f", "input_schema": OBJECT}, {"name": "f", "input_schema": OBJECT}]},
     "tools[1]", ".function"),
    ({"tools": [{"name": "f", "input_schema": 3}]}, "tools[0].input_schema", "parameters"),
])
def test_errors_name_the_messages_fields(gateway, api_key, extra, named, not_named):
    r = httpx.post(gateway.rest_url + "/v1/messages", json={**BASE, **extra}, timeout=10,
                   headers={"Authorization": f"Bearer {api_key}"})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    assert named in message and not_named not in message, message


def test_chat_keeps_its_own_names(gateway, api_key):
    r = httpx.post(gateway.rest_url + "/v1/chat/completions", timeout=10,
                   json={"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stop": [""]},
                   headers={"Authorization": f"Bearer {api_key}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
