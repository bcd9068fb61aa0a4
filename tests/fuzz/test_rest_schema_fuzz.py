"""Schemathesis against the gateway's own OpenAPI schema, over real HTTP to a real
gateway (private Redis, fake worker on the real gRPC link).

Every operation is fuzzed with schema-valid (positive) and schema-violating
(negative) cases, most with a valid API key and the rest with none, a ``Basic``
header, an unknown key, a revoked key or another tenant's key. Properties: never a
5xx, every call answers within ``CALL_TIMEOUT_S``, every 4xx is an OpenAI-shaped
``{"error": {...}}`` JSON body, and a well-formed request sent between the fuzzed ones
(every 5th case) and after them still succeeds. Both tenants' keys allow one request
in flight, so a slot leaked by any fuzzed request turns the next probe into a 429.
"""

from __future__ import annotations

import itertools

import pytest
import redis.asyncio
import schemathesis
from hypothesis import assume, given
from hypothesis import strategies as st
from schemathesis import GenerationMode

from gateway.rest import create_app
from gateway.service import GatewayService
from gateway.settings import GatewaySettings
from tests.fuzz.conftest import CALL_TIMEOUT_S, FUZZ, scripted
from tests.fuzz.probes import (assert_openai_error, assert_rest_still_works,
                                assert_worker_would_accept)
from tests.gateway.fake_tokenizer import CharTokenizer

PROBE_EVERY = 5


def openapi_schema() -> dict:
    """The OpenAPI document FastAPI generates for the gateway's app (the served app
    turns ``/openapi.json`` off; the schema is built from the same ``create_app``).
    Nothing connects: the Redis client is lazy and never used."""
    settings = GatewaySettings(redis_url="redis://127.0.0.1:1/0", served_model_name="test-model")
    service = GatewayService(settings, redis.asyncio.Redis.from_url(settings.redis_url), CharTokenizer())
    return create_app(service).openapi()


SCHEMA = schemathesis.openapi.from_dict(openapi_schema())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]

# How the Authorization header is filled in: mostly tenant a's valid key.
AUTH = st.sampled_from(["a", "a", "a", "a", "b", None, "basic", "unknown", "revoked", "bearer-empty"])


def authorization(kind: str | None, tenants: dict[str, str]) -> str | None:
    """The Authorization header value for ``kind`` (None = no header)."""
    return {None: None, "a": f"Bearer {tenants['a']}", "b": f"Bearer {tenants['b']}",
            "basic": "Basic dXNlcjpwYXNzd29yZA==", "unknown": "Bearer sk-inflight-not-a-key",
            "revoked": f"Bearer {tenants['revoked']}", "bearer-empty": "Bearer "}[kind]


def test_schema_has_every_route():
    """The fuzz covers every route of the app (a new route must show up here)."""
    assert {(op.method.upper(), op.path) for op in OPERATIONS} == {
        ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/v1/models"),
        ("GET", "/v1/models/{model_id}"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}


# Negative cases need something to break: the GET routes take no parameters or body.
CASES = [pytest.param(op, mode, id=f"{op.method.upper()} {op.path} {mode.value}")
         for op in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or op.body]


@pytest.mark.parametrize("operation,mode", CASES)
def test_fuzzed_rest_requests(fuzz_gateway, fuzz_worker, tenants, operation, mode):
    counter = itertools.count(1)

    @FUZZ
    @given(case=operation.as_strategy(generation_mode=mode), auth=AUTH)
    def run(case, auth):
        assume(not scripted(repr(case.body)) and not scripted(repr(case.query)))
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        value = authorization(auth, tenants)
        if value is not None:
            headers["Authorization"] = value
        case.headers = headers
        queued = len(fuzz_worker.requests)
        response = case.call(base_url=fuzz_gateway.rest_url, timeout=CALL_TIMEOUT_S)
        status, content_type = response.status_code, (response.headers.get("content-type") or [""])[0]
        assert status < 500, (status, response.text[:500])
        if 400 <= status < 500:
            assert_openai_error(status, content_type, response.content)
        elif operation.method.upper() == "POST":
            assert status == 200, (status, response.text[:500])
            assert auth in ("a", "b"), f"accepted without a valid key: {auth}"
            if content_type.startswith("text/event-stream"):
                assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
                assert '"error"' not in response.text, response.text[:500]
            else:
                assert response.json()["choices"], response.text[:500]
        assert_worker_would_accept(fuzz_worker.requests[queued:])
        if next(counter) % PROBE_EVERY == 0:
            assert_rest_still_works(fuzz_gateway.rest_url, tenants["a"])

    run()
    for tenant in ("a", "b"):
        assert_rest_still_works(fuzz_gateway.rest_url, tenants[tenant])
