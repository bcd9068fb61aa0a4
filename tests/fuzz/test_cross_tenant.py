"""Reaching another tenant's request by its id. The REST API has no route that takes
a request id (no read, no cancel); the one place a client names an id is gRPC
``GenerateRequest.request_id`` (client-chosen, echoed back). Reusing an id that is
in flight is refused, and the request that owns it is not disturbed."""

from __future__ import annotations

import uuid

import grpc
import httpx
import pytest

from gateway.grpc_server import MAX_REQUEST_ID_CHARS
from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.fuzz.conftest import CALL_TIMEOUT_S
from tests.fuzz.probes import assert_grpc_still_works, assert_openai_error, assert_rest_still_works


def meta(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/chat/completions/{rid}"), ("DELETE", "/v1/chat/completions/{rid}"),
    ("GET", "/v1/completions/{rid}"), ("POST", "/v1/chat/completions/{rid}/cancel"),
    ("GET", "/v1/requests/{rid}"), ("DELETE", "/v1/requests/{rid}"), ("GET", "/v1/responses/{rid}"),
])
def test_no_rest_route_reads_or_cancels_by_id(fuzz_gateway, fuzz_worker, tenants, method, path):
    """While tenant a's request streams, tenant b's attempts to read or cancel it by id
    through any plausible route are 404/405 with an OpenAI body, and a's stream goes on."""
    rid = f"victim-{uuid.uuid4().hex}"  # the fake worker remembers cancelled ids for 60 s
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(prompt="slow", request_id=rid), metadata=meta(tenants["a"]),
            timeout=CALL_TIMEOUT_S)
        assert next(call).text == "w0 "
        r = httpx.request(method, fuzz_gateway.rest_url + path.format(rid=rid), timeout=CALL_TIMEOUT_S,
                          headers={"Authorization": f"Bearer {tenants['b']}"})
        assert r.status_code in (404, 405), r.text
        assert_openai_error(r.status_code, r.headers.get("content-type", ""), r.content)
        assert [next(call).text for _ in range(3)] == ["w1 ", "w2 ", "w3 "]
        assert rid not in fuzz_worker.cancels
        call.cancel()


def test_reusing_another_tenants_request_id_is_refused_and_harmless(fuzz_gateway, fuzz_worker, tenants):
    rid = f"shared-{uuid.uuid4().hex}"
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        victim = stub.Generate(inference_pb2.GenerateRequest(prompt="slow", request_id=rid),
                               metadata=meta(tenants["a"]), timeout=CALL_TIMEOUT_S)
        assert next(victim).text == "w0 "
        queued = len(fuzz_worker.requests)
        for attempt in range(3):  # the intruder also gives up early (cancel) on the last try
            intruder = stub.Generate(inference_pb2.GenerateRequest(
                prompt="hi", request_id=rid, sampling=common_pb2.SamplingParams(max_tokens=2)),
                metadata=meta(tenants["b"]), timeout=CALL_TIMEOUT_S)
            with pytest.raises(grpc.RpcError) as info:
                list(intruder)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "already in use" in info.value.details()
            if attempt == 2:
                intruder.cancel()
        assert fuzz_worker.requests[queued:] == []  # nothing of the intruder was queued
        assert [next(victim).text for _ in range(3)] == ["w1 ", "w2 ", "w3 "]
        assert rid not in fuzz_worker.cancels
        victim.cancel()
        # Neither tenant holds a leaked in-flight slot (each key allows one).
        assert_grpc_still_works(channel, tenants["b"])
    assert_rest_still_works(fuzz_gateway.rest_url, tenants["a"])


@pytest.mark.parametrize("request_id", ["x" * (MAX_REQUEST_ID_CHARS + 1), "a\nb", "id\x00", "tab\there",
                                        "\u202eevil", "x" * 100_000])
def test_request_id_must_be_short_and_printable(fuzz_gateway, fuzz_worker, tenants, request_id):
    """Regression: any id was accepted (100 kB ids, newlines and NULs went to the queue,
    the worker, every reply and the logs)."""
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
        queued = len(fuzz_worker.requests)
        with pytest.raises(grpc.RpcError) as info:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(
                inference_pb2.GenerateRequest(prompt="hi", request_id=request_id),
                metadata=meta(tenants["a"]), timeout=CALL_TIMEOUT_S))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in info.value.details()
        assert fuzz_worker.requests[queued:] == []
        replies = list(inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(prompt="hi", request_id="é" * MAX_REQUEST_ID_CHARS,
                                          sampling=common_pb2.SamplingParams(max_tokens=2)),
            metadata=meta(tenants["a"]), timeout=CALL_TIMEOUT_S))
        assert {r.request_id for r in replies} == {"é" * MAX_REQUEST_ID_CHARS}
