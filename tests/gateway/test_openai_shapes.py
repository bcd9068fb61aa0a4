"""Every REST response has OpenAI's own shape: parsed by the ``openai`` package's pydantic
response models with nothing left over, and with exactly the fields OpenAI sends (no
``null`` that OpenAI leaves out). Reference shapes: OpenAI's API reference ("The chat
completion object", "The chat completion chunk object", "The completion object") and
what api.openai.com returns; we send a subset (no ``service_tier``, ``refusal``,
``annotations``, ``completion_tokens_details``), never a field OpenAI does not have."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from gateway.rest.openai_format import SYSTEM_FINGERPRINT, usage_of
from protos import common_pb2, link_pb2
from tests.helpers.sse import sse_data

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"prompt": "hello", "max_tokens": 3}
USAGE = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
RESPONSE = {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"}
CHUNK = {"id", "object", "created", "model", "choices", "system_fingerprint"}
CHOICE = {"index", "logprobs", "finish_reason"}
# The only nulls OpenAI sends in these objects: a choice's logprobs/finish_reason, and a
# stream chunk's usage with stream_options.include_usage (on every chunk but the last).
NULLABLE = {"logprobs", "finish_reason", "usage"}


def _post(gateway, path, body, key, **kw):
    return httpx.post(gateway.rest_url + path, json=body, timeout=10,
                      headers={"Authorization": f"Bearer {key}", **kw.pop("headers", {})}, **kw)


def _chunks(response) -> list[dict]:
    frames = ["data: " + d for d in sse_data(response.text)]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def _no_extras(model: BaseModel, path: str = "") -> None:
    """No field of the JSON fell into a model's extras (unknown to OpenAI's models)."""
    assert not model.model_extra, (path, model.model_extra)
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                _no_extras(item, f"{path}.{name}")


def _nulls(obj, path="") -> list[str]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items()
                for p in ([f"{path}.{k}"] if v is None else _nulls(v, f"{path}.{k}"))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _nulls(v, f"{path}[{i}]")]
    return []


def _check(model_cls, payload: dict) -> None:
    parsed = payload
    if model_cls is Completion and payload["choices"] and payload["choices"][0]["finish_reason"] is None:
        # OpenAI streams completions with "finish_reason": null until the last chunk, but the
        # SDK's Completion model (which it only constructs, unvalidated) does not allow null.
        parsed = {**payload, "choices": [{**payload["choices"][0], "finish_reason": "stop"}]}
    _no_extras(model_cls.model_validate(parsed))
    for path in _nulls(payload):
        assert path.rsplit(".", 1)[-1] in NULLABLE, (path, payload)
    assert payload["system_fingerprint"] == SYSTEM_FINGERPRINT


def test_chat_completion_shape(gateway, api_key):
    r = _post(gateway, "/v1/chat/completions", CHAT, api_key)
    body = r.json()
    _check(ChatCompletion, body)
    assert set(body) == RESPONSE and body["object"] == "chat.completion"
    assert set(body["choices"][0]) == CHOICE | {"message"}
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "w0 w1 w2 "}
    assert set(body["usage"]) == USAGE and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_shape(gateway, api_key):
    body = _post(gateway, "/v1/completions", COMPLETION, api_key).json()
    _check(Completion, body)
    assert set(body) == RESPONSE and body["object"] == "text_completion"
    assert set(body["choices"][0]) == CHOICE | {"text"} and set(body["usage"]) == USAGE


@pytest.mark.parametrize("options", [None, {"include_usage": False}])
def test_chat_stream_shape_without_usage(gateway, api_key, options):
    body = {**CHAT, "stream": True, **({"stream_options": options} if options else {})}
    chunks = _chunks(_post(gateway, "/v1/chat/completions", body, api_key))
    for c in chunks:
        _check(ChatCompletionChunk, c)
        assert set(c) == CHUNK and c["object"] == "chat.completion.chunk"
        assert set(c["choices"][0]) == CHOICE | {"delta"}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "w0 "}, {"content": "w1 "},
                      {"content": "w2 "}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]


def test_chat_stream_include_usage(gateway, api_key):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _chunks(_post(gateway, "/v1/chat/completions", body, api_key))
    for c in chunks:
        _check(ChatCompletionChunk, c)
        assert set(c) == CHUNK | {"usage"}
    assert [c["usage"] for c in chunks[:-1]] == [None] * 5  # as OpenAI sends them
    assert chunks[-1]["choices"] == [] and set(chunks[-1]["usage"]) == USAGE
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_completion_stream_shapes(gateway, api_key):
    plain = _chunks(_post(gateway, "/v1/completions", {**COMPLETION, "stream": True}, api_key))
    with_usage = _chunks(_post(gateway, "/v1/completions", {
        **COMPLETION, "stream": True, "stream_options": {"include_usage": True}}, api_key))
    for c in plain + with_usage:
        _check(Completion, c)
    assert all(set(c) == CHUNK for c in plain) and all(set(c) == CHUNK | {"usage"} for c in with_usage)
    assert [c["choices"][0]["text"] for c in plain] == ["w0 ", "w1 ", "w2 ", ""]
    assert all(set(c["choices"][0]) == CHOICE | {"text"} for c in plain)
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["total_tokens"] == 8


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_continuous_usage_stats(gateway, api_key, path, body):
    """vLLM's ``continuous_usage_stats`` (with ``include_usage``): usage so far on every chunk."""
    chunks = _chunks(_post(gateway, path, {**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}, api_key))
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == ([0] if "chat" in path else []) + [1, 2, 3, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == prompt and
               c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
    # continuous_usage_stats alone changes nothing, as in vLLM
    alone = _chunks(_post(gateway, path, {**body, "stream": True, "stream_options": {
        "continuous_usage_stats": True}}, api_key))
    assert all("usage" not in c for c in alone)


def test_cached_tokens_come_from_the_worker():
    finished = link_pb2.Finished(usage=common_pb2.Usage(prompt_tokens=10, completion_tokens=2,
                                                        cached_prompt_tokens=8))
    assert usage_of(finished).model_dump() == {
        "prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 8}}


def test_x_request_id_on_every_response(gateway, api_key):
    ok = _post(gateway, "/v1/chat/completions", CHAT, api_key)
    assert ok.headers["x-request-id"] == ok.json()["id"].removeprefix("chatcmpl-")
    stream = _post(gateway, "/v1/completions", {**COMPLETION, "stream": True}, api_key)
    assert stream.headers["x-request-id"] == _chunks(stream)[0]["id"].removeprefix("cmpl-")
    errors = [_post(gateway, "/v1/completions", {"prompt": "hi", "max_tokens": 0}, api_key),
              _post(gateway, "/v1/completions", COMPLETION, "sk-inflight-nope"),
              httpx.get(gateway.rest_url + "/v2/nothing"), httpx.get(gateway.rest_url + "/health"),
              _post(gateway, "/v1/completions", {"prompt": "x" * (2 << 20)}, api_key)]
    assert [r.status_code for r in errors] == [400, 401, 404, 200, 413]
    ids = [r.headers["x-request-id"] for r in errors]
    assert all(i.startswith("req-") for i in ids) and len(set(ids)) == len(ids)
    echoed = _post(gateway, "/v1/completions", COMPLETION, api_key, headers={"X-Request-Id": "trace-42"})
    refused = _post(gateway, "/v1/completions", {"prompt": "hi", "max_tokens": 0}, api_key,
                    headers={"x-request-id": "trace-43"})
    assert echoed.headers.get_list("x-request-id") == ["trace-42"]
    assert refused.headers["x-request-id"] == "trace-43"
    odd = _post(gateway, "/v1/completions", COMPLETION, api_key, headers={"x-request-id": "a b"})
    assert odd.headers["x-request-id"] != "a b"


def test_developer_role_and_assistant_null_content(gateway, api_key, fake_worker):
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None}, {"role": "assistant"},
                {"role": "user", "content": "again"}]
    r = _post(gateway, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}, api_key)
    assert r.status_code == 200, r.text
    queued = next(q for q in fake_worker.requests if q.request_id == r.headers["x-request-id"])
    prompt = "".join(chr(t) for t in queued.prompt_token_ids)
    assert prompt.startswith("<system>Be terse.\n") and "<assistant>\n" in prompt, prompt
    bad = _post(gateway, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": None}], "max_tokens": 2}, api_key)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content"


def test_openai_client_parses_everything(gateway, api_key):
    client = openai.OpenAI(base_url=gateway.rest_url + "/v1", api_key=api_key, max_retries=0, timeout=10)
    chat = client.chat.completions.create(
        model="test-model", max_tokens=3, messages=[{"role": "developer", "content": "x"},
                                                    {"role": "user", "content": "hi"}],
        frequency_penalty=0.5, presence_penalty=0.5, logit_bias={"5": 10})
    assert chat.system_fingerprint == SYSTEM_FINGERPRINT and chat.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(
        model="test-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].usage.completion_tokens == 3
    raw = client.completions.with_raw_response.create(model="test-model", prompt="hello", max_tokens=2)
    assert raw.headers["x-request-id"] and raw.parse().choices[0].text == "w0 w1 "
