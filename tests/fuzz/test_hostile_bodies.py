"""The hostile-input list of issue #8 that fuzzing does not reach reliably, sent
straight to the gateway (no nginx edge in front): oversized bodies, invalid UTF-8,
deep nesting, unknown roles, huge stop lists, non-Bearer Authorization headers.
Each is refused with an OpenAI error (gRPC: a mapped status), and a well-formed
request afterwards still succeeds."""

from __future__ import annotations

import json
import socket

import grpc
import httpx
import pytest

from gateway.rest.body_limit import MAX_BODY_BYTES
from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.fuzz.conftest import CALL_TIMEOUT_S
from tests.fuzz.probes import assert_grpc_still_works, assert_openai_error, assert_rest_still_works

CHAT = "/v1/chat/completions"


def post_raw(gateway, key: str | None, content: bytes, path: str = CHAT, **headers) -> httpx.Response:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    headers.setdefault("Content-Type", "application/json")
    return httpx.post(gateway.rest_url + path, content=content, headers=headers, timeout=CALL_TIMEOUT_S)


def error_of(r: httpx.Response) -> dict:
    return assert_openai_error(r.status_code, r.headers.get("content-type", ""), r.content)


@pytest.fixture()
def key(tenants):
    return tenants["a"]


def test_oversized_body_is_413_without_the_edge(fuzz_gateway, key):
    """Regression: the gateway parsed any body size; a 2M-id prompt held the event loop
    (every client) for seconds before its 400. Declared and chunked bodies above
    ``MAX_BODY_BYTES`` are refused before parsing."""
    big = json.dumps({"prompt": [1] * (MAX_BODY_BYTES // 3)}).encode()
    assert len(big) > MAX_BODY_BYTES
    r = post_raw(fuzz_gateway, key, big, "/v1/completions")
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"

    def chunks():  # no Content-Length: Transfer-Encoding: chunked
        for start in range(0, len(big), 65536):
            yield big[start:start + 65536]
    r = httpx.post(fuzz_gateway.rest_url + "/v1/completions", content=chunks(), timeout=CALL_TIMEOUT_S,
                   headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "body_too_large"
    under = json.dumps({"prompt": "x" * (MAX_BODY_BYTES - 100)}).encode()
    r = post_raw(fuzz_gateway, key, under, "/v1/completions")  # parsed: too many tokens, not too big
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    assert_rest_still_works(fuzz_gateway.rest_url, key)


def test_lying_content_length_is_refused_before_reading(fuzz_gateway, key):
    """A Content-Length of 1 GB with no body behind it gets 413 at once (no wait for it)."""
    host, port = fuzz_gateway.rest_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {10**9}\r\n\r\n{{".encode())
        reply = b""
        while b'"body_too_large"' not in reply and (chunk := sock.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert b'"body_too_large"' in reply


def test_grpc_oversized_message_is_resource_exhausted(fuzz_gateway, key):
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(inference_pb2.GenerateRequest(prompt="x" * (5 << 20)),
                               metadata=(("authorization", f"Bearer {key}"),), timeout=CALL_TIMEOUT_S))
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert_grpc_still_works(channel, key)


@pytest.mark.parametrize("content", [
    b'{"messages": [{"role": "user", "content": "hi \xff\xfe there"}]}',  # invalid UTF-8 in a string
    b'\xff\xfe{"messages": []}',                                          # invalid UTF-8 outside
    b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',       # UTF-8-encoded surrogate
    b'{"messages": [{"role": "us\xc3\x28er", "content": "hi"}]}',
], ids=["in-string", "leading", "encoded-surrogate", "in-role"])
def test_invalid_utf8_body_is_400(fuzz_gateway, key, content):
    r = post_raw(fuzz_gateway, key, content)
    assert r.status_code == 400, r.text
    assert error_of(r)["type"] == "invalid_request_error"
    assert_rest_still_works(fuzz_gateway.rest_url, key)


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("where", ["body", "messages", "content", "stop", "stop_token_ids"])
def test_deeply_nested_json_is_400(fuzz_gateway, key, where, depth):
    nest = "[" * depth + "]" * depth
    body = {"body": nest,
            "messages": '{"messages": %s}' % nest,
            "content": '{"messages": [{"role": "user", "content": %s}]}' % nest,
            "stop": '{"messages": [{"role": "user", "content": "hi"}], "stop": %s}' % nest,
            "stop_token_ids": '{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": %s}'
                              % nest}[where]
    r = post_raw(fuzz_gateway, key, body.encode())
    assert r.status_code == 400, r.text
    error_of(r)
    assert_rest_still_works(fuzz_gateway.rest_url, key)


@pytest.mark.parametrize("role", ["robot", "", "USER", "developer\x00", None, 7, ["user"], {"a": 1}])
def test_unknown_roles_are_400_on_rest_and_grpc(fuzz_gateway, key, role):
    """Regression: a list or object role (unhashable) was a 500, not a 400."""
    r = post_raw(fuzz_gateway, key, json.dumps({"messages": [{"role": role, "content": "hi"}]}).encode())
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0].role", r.text
    if isinstance(role, str):
        with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
            request = inference_pb2.GenerateRequest(chat=inference_pb2.ChatMessages(
                messages=[inference_pb2.ChatMessage(role=role, content="hi")]))
            with pytest.raises(grpc.RpcError) as info:
                list(inference_pb2_grpc.InferenceStub(channel).Generate(
                    request, metadata=(("authorization", f"Bearer {key}"),), timeout=CALL_TIMEOUT_S))
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("stop", [["x"] * 100_000, ["y" * 100_000], [""], "z" * 10_000])
def test_huge_stop_lists_are_400_on_rest_and_grpc(fuzz_gateway, key, stop):
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": stop}
    r = post_raw(fuzz_gateway, key, json.dumps(body).encode())
    assert r.status_code == 400 and error_of(r)["param"] == "stop", r.text
    stops = [stop] if isinstance(stop, str) else stop
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
        request = inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(stop=stops))
        with pytest.raises(grpc.RpcError) as info:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(
                request, metadata=(("authorization", f"Bearer {key}"),), timeout=CALL_TIMEOUT_S))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "stop" in info.value.details()
    assert_rest_still_works(fuzz_gateway.rest_url, key)


@pytest.mark.parametrize("scheme", ["Basic {}", "Token {}", "Digest {}", "{}", "Bearer",
                                    "Basic c2staW5mbGlnaHQ6eA==", "Bearer {} extra"])
def test_non_key_authorization_is_refused(fuzz_gateway, key, scheme):
    """Schemes other than ``Bearer <key>`` are 401 / UNAUTHENTICATED, even when they
    carry a valid key (``Basic <key>``, a bare key, trailing junk)."""
    value = scheme.format(key)
    r = post_raw(fuzz_gateway, None, json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                 Authorization=value)
    assert r.status_code == 401 and error_of(r)["type"] == "authentication_error", r.text
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(prompt="hi"), metadata=(("authorization", value),),
                timeout=CALL_TIMEOUT_S))
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
