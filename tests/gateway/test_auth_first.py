"""A bad API key is 401 whatever the body, on every REST route that takes one
(gateway/rest/auth_first.py): FastAPI validated the body first, so a bad key with an invalid
body got 400. A good key with an invalid body still gets 400, authenticated once."""

from __future__ import annotations

import httpx
import pytest

from gateway.admission.pipeline import Admission
from gateway.rest.auth_first import AUTH_FIRST_PATHS

BAD = {"Authorization": "Bearer sk-inflight-not-a-key"}


@pytest.mark.parametrize("path", sorted(AUTH_FIRST_PATHS))
@pytest.mark.parametrize("body", [b'{"model": 3}', b"not json"])
def test_a_bad_key_is_401_whatever_the_body(gateway, redis_url, path, body):
    got = httpx.post(f"{gateway.rest_url}{path}", content=body,
                     headers={**BAD, "Content-Type": "application/json"}, timeout=10)
    assert got.status_code == 401, got.text


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/embeddings", "/tokenize"])
def test_a_bad_x_api_key_is_401_where_x_api_key_is_read(gateway, redis_url, path):
    got = httpx.post(f"{gateway.rest_url}{path}", json={"model": 3},
                     headers={"x-api-key": "sk-inflight-not-a-key"}, timeout=10)
    assert got.status_code == 401, got.text


def test_a_good_key_with_a_bad_body_is_400_and_authenticated_once(gateway, api_key, monkeypatch):
    looked_up = []
    original = Admission.authenticate

    async def counting(self, authorization):
        from gateway.admission.pipeline import PRE_AUTHENTICATED
        if PRE_AUTHENTICATED.get() is None:
            looked_up.append(authorization)
        return await original(self, authorization)

    monkeypatch.setattr(Admission, "authenticate", counting)
    headers = {"Authorization": f"Bearer {api_key}"}
    got = httpx.post(f"{gateway.rest_url}/v1/chat/completions", json={"model": 3}, headers=headers, timeout=10)
    assert got.status_code == 400, got.text
    got = httpx.post(f"{gateway.rest_url}/v1/chat/completions", headers=headers, timeout=10,
                     json={"model": "test-model", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "SAY[ab]SAY"}]})
    assert got.status_code == 200, got.text
    assert len(looked_up) == 2  # one Redis lookup per request, not two


@pytest.mark.parametrize("path,names_x_api_key", [("/v1/messages", True), ("/tokenize", True),
                                                  ("/v1/chat/completions", False)])
def test_a_missing_key_names_the_headers_the_route_reads(gateway, redis_url, path, names_x_api_key):
    """An anthropic-style caller without a key was told only "send 'Authorization: Bearer
    <key>'"; where x-api-key is read, the 401 names it too (and only there)."""
    got = httpx.post(f"{gateway.rest_url}{path}", json={}, timeout=10)
    assert got.status_code == 401, got.text
    body = got.json()
    message = body["error"]["message"]
    assert ("x-api-key" in message) is names_x_api_key and "Authorization: Bearer" in message
