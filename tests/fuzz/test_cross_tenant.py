"""Reaching another tenant's request by its id. The REST API has no route that takes
a request id (no read, no cancel); the one place a client names an id is gRPC
``GenerateRequest.request_id`` (client-chosen, echoed back). Ids are scoped by API key
(gateway.service.internal_request_id): another tenant using the same id gets its own,
independent request; reusing an id this key has in flight is refused."""

from __future__ import annotations

import uuid

import grpc
import httpx
import pytest

from gateway.admission.request_id import MAX_REQUEST_ID_CHARS
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
        assert not any(c.endswith(rid) for c in fuzz_worker.cancels)
        call.cancel()


def test_another_tenant_using_the_same_id_gets_its_own_request(fuzz_gateway, fuzz_worker, tenants):
    rid = f"shared-{uuid.uuid4().hex}"
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        victim = stub.Generate(inference_pb2.GenerateRequest(prompt="slow", request_id=rid),
                               metadata=meta(tenants["a"]), timeout=CALL_TIMEOUT_S)
        assert next(victim).text == "w0 "
        for attempt in range(2):  # the other tenant's requests with the same id run on their own
            other = list(stub.Generate(inference_pb2.GenerateRequest(
                prompt="hi", request_id=rid, sampling=common_pb2.SamplingParams(max_tokens=2)),
                metadata=meta(tenants["b"]), timeout=CALL_TIMEOUT_S))
            assert other[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert all(m.request_id == rid for m in other)
        assert [next(victim).text for _ in range(3)] == ["w1 ", "w2 ", "w3 "]
        assert not any(c.endswith(rid) for c in fuzz_worker.cancels)
        victim.cancel()
        # Neither tenant holds a leaked in-flight slot (each key allows one).
        assert_grpc_still_works(channel, tenants["b"])
    assert_rest_still_works(fuzz_gateway.rest_url, tenants["a"])


def test_reusing_an_id_this_key_has_in_flight_is_refused(fuzz_gateway, fuzz_worker, tenants):
    rid = f"mine-{uuid.uuid4().hex}"
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        first = stub.Generate(inference_pb2.GenerateRequest(prompt="slow", request_id=rid),
                              metadata=meta(tenants["a"]), timeout=CALL_TIMEOUT_S)
        assert next(first).text == "w0 "
        queued = len(fuzz_worker.requests)
        again = stub.Generate(inference_pb2.GenerateRequest(prompt="hi", request_id=rid),
                              metadata=meta(tenants["a"]), timeout=CALL_TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as info:
            list(again)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "already in use" in info.value.details() and rid in info.value.details()
        assert fuzz_worker.requests[queued:] == []
        assert [next(first).text for _ in range(2)] == ["w1 ", "w2 "]
        first.cancel()
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
