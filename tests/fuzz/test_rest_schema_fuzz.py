"""Schemathesis against the OpenAPI schema the gateway serves (``GET /openapi.json`` of the
running gateway), over real HTTP to a real gateway (private Redis, fake worker on the
real gRPC link).

Every operation is fuzzed with schema-valid (positive) and schema-violating
(negative) cases, most with a valid API key and the rest with none, a ``Basic``
header, an unknown key, a revoked key or another tenant's key. Properties: never a
5xx, every call answers within ``CALL_TIMEOUT_S``, every 4xx is an OpenAI-shaped
``{"error": {...}}`` JSON body (Anthropic's ``{"type": "error", "error": {...}}`` under
``/v1/messages``), and a well-formed request sent between the fuzzed ones
(every 5th case) and after them still succeeds. Both tenants' keys allow one request
in flight, so a slot leaked by any fuzzed request turns the next probe into a 429.
"""

from __future__ import annotations

import gc
import itertools

import pytest
import schemathesis
from hypothesis import assume, given
from hypothesis import strategies as st
from schemathesis import GenerationMode
# Imported at collection, not first inside from_url at fixture time: pytest's assertion
# rewriting parses these modules, and a garbage collection during that parse that runs an
# earlier test's task finalizer (grpc.aio's "Task was destroyed but it is pending!") raised
# CPython 3.11's "SystemError: AST constructor recursion depth mismatch" in one full-suite run.
import schemathesis.specs.openapi.adapter  # noqa: F401,E402
import schemathesis.specs.openapi.schemas  # noqa: F401,E402

from tests.fuzz.conftest import CALL_TIMEOUT_S, FUZZ, scripted
from tests.fuzz.probes import (assert_anthropic_error, assert_openai_error,
                                assert_rest_still_works, assert_worker_would_accept)

PROBE_EVERY = 5


# The routes and, per route, whether it takes a body (negative cases need something to
# break: the GET routes take no parameters or body). test_served_schema_has_every_route
# checks this list against the schema the gateway serves.
ROUTES = [("GET", "/health", False), ("GET", "/ready", False), ("GET", "/metrics", False),
          ("GET", "/v1/models", False), ("GET", "/v1/models/{model_id}", False),
          ("POST", "/v1/completions", True), ("POST", "/v1/chat/completions", True),
          ("POST", "/tokenize", True), ("POST", "/detokenize", True),
          ("POST", "/v1/messages", True), ("POST", "/v1/messages/count_tokens", True),
          ("POST", "/v1/responses", True), ("GET", "/v1/responses/{response_id}", False),
          ("DELETE", "/v1/responses/{response_id}", False), ("GET", "/fleet", False),
          ("POST", "/v1/embeddings", True), ("POST", "/v1/load_lora_adapter", True),
          ("POST", "/v1/unload_lora_adapter", True)]
#: Routes whose errors take Anthropic's shape instead of OpenAI's.
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


def assert_accepted(path: str, content_type: str, response) -> None:
    """What a 200 of ``path`` holds: a generation's choices (or its stream's end), a
    Messages answer's content (or its stream's message_stop), the tokenizer's answer."""
    if content_type.startswith("text/event-stream") and path == "/v1/responses":
        tail = response.text[-20000:]
        assert "event: response.completed" in tail or "event: response.incomplete" in tail, tail[-300:]
        assert "response.failed" not in response.text, response.text[:500]
        return
    if content_type.startswith("text/event-stream"):
        end = "event: message_stop" if path == "/v1/messages" else "data: [DONE]"
        assert end in response.text[-300:], response.text[-300:]
        assert '"error"' not in response.text, response.text[:500]
        return
    body = response.json()
    key = {"/tokenize": "tokens", "/detokenize": "prompt", "/v1/messages": "content",
           "/v1/messages/count_tokens": "input_tokens", "/v1/responses": "output", "/v1/embeddings": "data"}.get(path, "choices")
    assert key in body and (key != "choices" or body[key]), response.text[:500]


@pytest.fixture(scope="module")
def served_schema(fuzz_gateway):
    """The OpenAPI document the running gateway serves at ``/openapi.json``."""
    gc.collect()  # earlier tests' finalizers run here, not inside a parse (above)
    return schemathesis.openapi.from_url(fuzz_gateway.rest_url + "/openapi.json")


# How the Authorization header is filled in: mostly tenant a's valid key.
AUTH = st.sampled_from(["a", "a", "a", "a", "b", None, "basic", "unknown", "revoked", "bearer-empty"])


def authorization(kind: str | None, tenants: dict[str, str]) -> str | None:
    """The Authorization header value for ``kind`` (None = no header)."""
    return {None: None, "a": f"Bearer {tenants['a']}", "b": f"Bearer {tenants['b']}",
            "basic": "Basic dXNlcjpwYXNzd29yZA==", "unknown": "Bearer sk-inflight-not-a-key",
            "revoked": f"Bearer {tenants['revoked']}", "bearer-empty": "Bearer "}[kind]


def test_served_schema_has_every_route(served_schema):
    """The fuzz covers every route the served schema documents (a new route must show up here)."""
    operations = [result.ok() for result in served_schema.get_all_operations()]
    assert {(op.method.upper(), op.path, bool(op.body)) for op in operations} == set(ROUTES)


CASES = [pytest.param(method, path, mode, id=f"{method} {path} {mode.value}")
         for method, path, has_body in ROUTES
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if mode is GenerationMode.POSITIVE or has_body]


@pytest.mark.parametrize("method,path,mode", CASES)
def test_fuzzed_rest_requests(fuzz_gateway, fuzz_worker, tenants, served_schema, method, path, mode):
    operation = served_schema[path][method]
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
            if path in ANTHROPIC:
                assert_anthropic_error(status, content_type, response.content)
            else:
                assert_openai_error(status, content_type, response.content)
        elif operation.method.upper() == "POST":
            assert status == 200, (status, response.text[:500])
            assert auth in ("a", "b"), f"accepted without a valid key: {auth}"
            assert_accepted(path, content_type, response)
        assert_worker_would_accept(fuzz_worker.requests[queued:])
        if next(counter) % PROBE_EVERY == 0:
            assert_rest_still_works(fuzz_gateway.rest_url, tenants["a"])

    run()
    for tenant in ("a", "b"):
        assert_rest_still_works(fuzz_gateway.rest_url, tenants[tenant])
