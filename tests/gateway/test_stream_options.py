"""``stream_options`` sent without ``stream: true`` is a 400 naming it, as OpenAI and vLLM
answer (gateway/rest/unsupported.py); it was silently accepted."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_is_400(gateway, api_key, path, body, stream):
    """As OpenAI and vLLM answer (gateway/rest/unsupported.py); ``null`` options are fine."""
    headers = {"Authorization": f"Bearer {api_key}"}
    sent = {**body, "max_tokens": 2, "stream_options": {"include_usage": True}}
    if stream is not None:
        sent["stream"] = stream
    got = httpx.post(f"{gateway.rest_url}{path}", json=sent, headers=headers, timeout=10)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == "stream_options"
    got = httpx.post(f"{gateway.rest_url}{path}", json={**sent, "stream_options": None}, headers=headers, timeout=10)
    assert got.status_code == 200, got.text
