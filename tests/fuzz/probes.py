"""What every fuzz test asserts: the OpenAI error shape of a 4xx, and that a
well-formed request still succeeds (REST and gRPC) after hostile ones."""

from __future__ import annotations

import json

import grpc
import httpx

from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.fuzz.conftest import CALL_TIMEOUT_S

WELL_FORMED_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
FAKE_TOKENS = ["w0 ", "w1 ", "w2 "]  # the fake worker's pieces for max_tokens=3


def assert_openai_error(status: int, content_type: str, body: bytes) -> dict:
    """Assert ``body`` is OpenAI's ``{"error": {"message", "type", "param", "code"}}``
    JSON for an error status; returns the inner error object."""
    assert content_type.startswith("application/json"), (status, content_type, body[:300])
    payload = json.loads(body)
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert isinstance(error, dict), payload
    assert isinstance(error.get("message"), str) and error["message"], payload
    assert isinstance(error.get("type"), str) and error["type"].endswith("_error"), payload
    assert "param" in error and "code" in error, payload
    return error


def assert_anthropic_error(status: int, content_type: str, body: bytes) -> dict:
    """Assert ``body`` is Anthropic's ``{"type": "error", "error": {"type", "message"}}`` JSON
    for an error status; returns the inner error object."""
    assert content_type.startswith("application/json"), (status, content_type, body[:300])
    payload = json.loads(body)
    assert isinstance(payload, dict) and payload.get("type") == "error" and set(payload) == {"type", "error"}, payload
    error = payload["error"]
    assert isinstance(error, dict) and set(error) == {"type", "message"}, payload
    assert isinstance(error["message"], str) and error["message"], payload
    assert isinstance(error["type"], str) and error["type"].endswith(("_error", "request_too_large")), payload
    return error


def assert_rest_still_works(rest_url: str, key: str) -> None:
    """A well-formed chat request with ``key`` gets 200 and the fake worker's 3 tokens."""
    r = httpx.post(rest_url + "/v1/chat/completions", json=WELL_FORMED_CHAT, timeout=CALL_TIMEOUT_S,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "".join(FAKE_TOKENS)
    assert body["usage"]["completion_tokens"] == 3


def assert_grpc_still_works(channel: grpc.Channel, key: str) -> None:
    """A well-formed gRPC Generate with ``key`` streams the fake worker's 3 tokens and
    ends with usage."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    replies = list(stub.Generate(
        inference_pb2.GenerateRequest(prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=3)),
        metadata=(("authorization", f"Bearer {key}"),), timeout=CALL_TIMEOUT_S))
    assert [r.text for r in replies if r.text] == FAKE_TOKENS
    assert replies[-1].usage.completion_tokens == 3


def assert_worker_would_accept(queued, vocab_size: int = 300, context_length: int = 128) -> None:
    """Every ``QueuedRequest`` the gateway queued passes the real worker's own checks
    (``worker.engine.engine``'s: non-empty prompt of in-vocabulary ids, ``SamplingParams.validate``,
    prompt + max_tokens within the context). Defaults: ``CharTokenizer``'s sizes.
    Whatever the gateway admits must not be refused (or crash) on the worker."""
    from worker.serve.request_codec import to_sampling_params

    for q in queued:
        ids = list(q.prompt_token_ids)
        assert ids and all(0 <= t < vocab_size for t in ids), q
        assert q.sampling.max_tokens >= 1, q
        assert q.sampling.n <= 16, q  # GatewaySettings.max_n's default
        assert len(ids) + q.sampling.max_tokens <= context_length, q
        to_sampling_params(q.sampling).validate(vocab_size)
