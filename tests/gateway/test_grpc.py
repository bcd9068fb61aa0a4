"""Public gRPC front over loopback: Generate, ListModels, health, reflection, cancel."""

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.promtext import sample_sum
from gateway import keys
from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.gateway.conftest import wait_for


@pytest.fixture()
def channel(gateway):
    with grpc.insecure_channel(gateway.grpc_target) as ch:
        yield ch


def auth(key):
    return (("authorization", f"Bearer {key}"),)


def test_generate_streams(channel, api_key):
    stub = inference_pb2_grpc.InferenceStub(channel)
    req = inference_pb2.GenerateRequest(
        prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=3), request_id="abc")
    replies = list(stub.Generate(req, metadata=auth(api_key), timeout=10))
    assert "".join(r.text for r in replies) == "w0 w1 w2 "
    assert all(r.request_id == "abc" for r in replies)
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert replies[-1].usage.completion_tokens == 3


def test_chat_and_list_models(channel, api_key):
    stub = inference_pb2_grpc.InferenceStub(channel)
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="hi")])
    replies = list(stub.Generate(inference_pb2.GenerateRequest(chat=chat), metadata=auth(api_key)))
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    models = stub.ListModels(inference_pb2.ListModelsRequest(), metadata=auth(api_key))
    assert models.models[0].id == "test-model" and models.models[0].context_length == 128


@pytest.mark.parametrize("sampling,code", [
    (common_pb2.SamplingParams(temperature=-1), grpc.StatusCode.INVALID_ARGUMENT),
    (common_pb2.SamplingParams(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
    (common_pb2.SamplingParams(max_tokens=500), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_invalid_argument(channel, api_key, sampling, code):
    stub = inference_pb2_grpc.InferenceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(inference_pb2.GenerateRequest(prompt="hi", sampling=sampling),
                           metadata=auth(api_key)))
    assert info.value.code() == code


def test_generate_is_counted_under_its_model(channel, api_key, gateway):
    """inflight_gateway_requests_total{endpoint="grpc.Generate"}: the served model's id on a
    served stream and on a refusal after the model was resolved (INVALID_ARGUMENT), "" before."""
    stub = inference_pb2_grpc.InferenceStub(channel)

    def counted(status: str, model_name: str) -> float:
        text = httpx.get(gateway.rest_url + "/metrics", timeout=5).text
        return sample_sum(text, "inflight_gateway_requests_total",
                          {"endpoint": "grpc.Generate", "status": status, "model_name": model_name})

    before = [counted("OK", "test-model"), counted("INVALID_ARGUMENT", "test-model"), counted("NOT_FOUND", "")]
    list(stub.Generate(inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=2)),
                       metadata=auth(api_key), timeout=10))
    for request in (inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(top_p=1.5)),
                    inference_pb2.GenerateRequest(prompt="hi", model="no-such-model")):
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(request, metadata=auth(api_key), timeout=10))
    after = [counted("OK", "test-model"), counted("INVALID_ARGUMENT", "test-model"), counted("NOT_FOUND", "")]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]


def test_unauthenticated(channel, api_key):
    stub = inference_pb2_grpc.InferenceStub(channel)
    for md in ((), auth("sk-inflight-nope")):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(inference_pb2.GenerateRequest(prompt="hi"), metadata=md))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_client_cancel_reaches_worker(channel, api_key, fake_worker):
    stub = inference_pb2_grpc.InferenceStub(channel)
    call = stub.Generate(inference_pb2.GenerateRequest(prompt="slow", request_id="cancel-me"),
                         metadata=auth(api_key))
    assert next(call).text == "w0 "
    call.cancel()
    # the worker sees the id scoped by the key (gateway.service.internal_request_id)
    assert wait_for(lambda: any(c.endswith(":cancel-me") for c in fake_worker.cancels))


def test_health_and_reflection(channel, gateway):
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="inflight.v1.Inference"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert "inflight.v1.Inference" in names


def test_deadline_cancels_on_worker(channel, api_key, fake_worker):
    stub = inference_pb2_grpc.InferenceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(inference_pb2.GenerateRequest(prompt="slow", request_id="late"),
                           metadata=auth(api_key), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: any(c.endswith(":late") for c in fake_worker.cancels))
    assert fake_worker.requests[-1].deadline_unix_s > 0


def test_fake_worker_serves_after_flushall_during_its_blocked_read(gateway, fake_worker, redis_url):
    """Regression: on Redis >= 7.0 a FLUSHALL ends the worker's blocked XREADGROUP with
    "UNBLOCKED the stream key no longer exists"; the fake worker used to die on it, so every
    later request stayed queued until its deadline (per-test FLUSHALL made that test-order
    dependent). It must recreate its group and keep serving."""
    client = redis.Redis.from_url(redis_url)
    assert wait_for(lambda: any(c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")
                                for c in client.client_list()))
    client.flushall()
    _, key = keys.create_key(client, "tenant-a", "test")
    client.close()
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        req = inference_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=1))
        replies = list(stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=5))
    assert replies[-1].usage.completion_tokens == 1
    fake_worker.check()
