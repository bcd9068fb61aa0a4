"""Hypothesis-built REST bodies whose sampling fields take edge values, which
schemathesis's schema-driven generation rarely reaches: float32 overflow (1e308),
float32 underflow (1e-320), integers past 64 bits, NaN/inf spelled as JSON numbers
that overflow, wrong JSON types. Properties as in the schema fuzz (never a 5xx,
OpenAI error shape, bounded time) plus: whatever the gateway queues passes the real
worker's own checks (a 200 here must never become a refusal or a crash there).
"""

from __future__ import annotations

import json

import httpx
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.fuzz.conftest import CALL_TIMEOUT_S, FUZZ, scripted
from tests.fuzz.probes import assert_openai_error, assert_rest_still_works, assert_worker_would_accept

INT_EDGES = [0, -1, 2**31, 2**32, 2**63 - 1, 2**63, -2**63 - 1, 2**64, 10**30, 1.0, 2.5]
FLOAT_EDGES = [-0.0, 1e-45, 1e-320, 5e-324, 3.4e38, 3.5e38, 1e308, -1e308, 2**64, 10**30]
EDGES = {"temperature": FLOAT_EDGES, "top_p": FLOAT_EDGES}  # the rest are integer fields
EDGE_NUMBERS = st.sampled_from(INT_EDGES + FLOAT_EDGES)
# Spelled in the JSON text: 1e999 parses to inf, a 400-digit integer to a Python int.
RAW_NUMBERS = st.sampled_from(["1e999", "-1e999", "9" * 400, "-" + "9" * 400, "1e-999"])
ODD_VALUES = st.sampled_from([None, True, False, "1", "", [], {}, [1], {"a": 1}])
# Valid values per field, so that one edge value at a time can get past the others.
VALID = {"max_tokens": [1, 3], "max_completion_tokens": [2], "temperature": [0, 0.7, 1],
         "top_p": [0.9, 1], "top_k": [-1, 0, 40], "seed": [0, 7], "n": [1, 2], "priority": [1, 2],
         "top_logprobs": [0, 2], "logprobs": [1], "stop_token_ids": [[], [5]], "ignore_eos": [False],
         "skip_special_tokens": [True]}
FIELDS = sorted(VALID)


@st.composite
def bodies(draw) -> tuple[str, str]:
    """``(path, JSON text)``: a chat or completion body with edge-valued fields."""
    chat = draw(st.booleans())
    fields = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    raw: dict[str, str] = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=5)):
        choice = draw(st.sampled_from(["valid", "valid", "edge", "edge", "raw", "odd", "list"]))
        if choice == "valid":
            fields[name] = draw(st.sampled_from(VALID[name]))
        elif choice == "edge":
            fields[name] = draw(st.sampled_from(EDGES.get(name, INT_EDGES)))
        elif choice == "odd":
            fields[name] = draw(ODD_VALUES)
        elif choice == "list":
            fields[name] = draw(st.lists(EDGE_NUMBERS, max_size=70))
        else:
            raw[name] = draw(RAW_NUMBERS)
    if chat and fields.get("logprobs") == 1:
        fields["logprobs"] = True  # chat's logprobs is a boolean (top_logprobs the count)
    text = json.dumps(fields)
    extra = "".join(f', "{k}": {v}' for k, v in raw.items())
    return ("/v1/chat/completions" if chat else "/v1/completions"), text[:-1] + extra + "}"


def test_edge_valued_sampling_fields(fuzz_gateway, fuzz_worker, tenants):
    headers = {"Authorization": f"Bearer {tenants['a']}", "Content-Type": "application/json"}

    @FUZZ
    @given(request=bodies())
    def run(request):
        path, text = request
        assume(not scripted(text))
        queued = len(fuzz_worker.requests)
        r = httpx.post(fuzz_gateway.rest_url + path, content=text.encode(), headers=headers,
                       timeout=CALL_TIMEOUT_S)
        assert r.status_code < 500, (r.status_code, r.text)
        if r.status_code >= 400:
            assert_openai_error(r.status_code, r.headers.get("content-type", ""), r.content)
        assert_worker_would_accept(fuzz_worker.requests[queued:])

    run()
    assert_rest_still_works(fuzz_gateway.rest_url, tenants["a"])


def test_float32_overflow_and_underflow_are_400(fuzz_gateway, fuzz_worker, tenants):
    """Regression: temperature 1e308 passed validation (finite as a double) and reached
    the worker as inf (protobuf ``float``); top_p 1e-320 reached it as 0.0. The worker
    refuses both; the gateway now answers 400 naming the parameter."""
    headers = {"Authorization": f"Bearer {tenants['a']}"}
    for field, value in (("temperature", 1e308), ("temperature", 3.5e38), ("top_p", 1e-320),
                         ("top_p", 5e-324)):
        queued = len(fuzz_worker.requests)
        r = httpx.post(fuzz_gateway.rest_url + "/v1/completions", headers=headers, timeout=CALL_TIMEOUT_S,
                       json={"prompt": "hi", "max_tokens": 2, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field
        assert fuzz_worker.requests[queued:] == []
    ok = httpx.post(fuzz_gateway.rest_url + "/v1/completions", headers=headers, timeout=CALL_TIMEOUT_S,
                    json={"prompt": "hi", "max_tokens": 2, "temperature": 3.4e38, "top_p": 1e-30})
    assert ok.status_code == 200, ok.text


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)
ROLES = st.sampled_from(["user", "system", "assistant", "tool"]) | JSON_VALUES


@st.composite
def messages(draw) -> list:
    """Chat messages whose role, content and shape are arbitrary JSON (the schema says
    only "a list"): a list/object role, content parts of any shape, non-object messages."""
    def message():
        return st.fixed_dictionaries({"role": ROLES, "content": st.text(max_size=20) | JSON_VALUES}) | JSON_VALUES
    return draw(st.lists(message(), max_size=4))


def test_arbitrary_json_messages(fuzz_gateway, fuzz_worker, tenants):
    """Regression fuzz for the unhashable-role 500 (``{"role": ["user"]}``)."""
    headers = {"Authorization": f"Bearer {tenants['a']}"}

    @FUZZ
    @given(msgs=messages())
    def run(msgs):
        assume(not scripted(json.dumps(msgs)))
        queued = len(fuzz_worker.requests)
        r = httpx.post(fuzz_gateway.rest_url + "/v1/chat/completions", headers=headers,
                       timeout=CALL_TIMEOUT_S, json={"messages": msgs, "max_tokens": 2})
        assert r.status_code < 500, (r.status_code, r.text)
        if r.status_code >= 400:
            assert_openai_error(r.status_code, r.headers.get("content-type", ""), r.content)
        assert_worker_would_accept(fuzz_worker.requests[queued:])

    run()
    assert_rest_still_works(fuzz_gateway.rest_url, tenants["a"])
