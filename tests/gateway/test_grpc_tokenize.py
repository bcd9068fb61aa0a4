"""gRPC ``Tokenize`` and ``Detokenize`` (issue 45 item 7) over loopback against the real
gateway and Redis: the same answers as REST's ``/tokenize`` and ``/detokenize``, the key and
its requests/min window, INVALID_ARGUMENT for bad input, never queued, listed by reflection."""

from __future__ import annotations

import grpc
import httpx
import pytest
import redis
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
    ProtoReflectionDescriptorDatabase

from common.redis_keys import stream_name
from tests.gateway.fake_worker import MODEL
from gateway import keys
from protos import common_pb2, inference_pb2, inference_pb2_grpc

TOOL = inference_pb2.Tool(function=inference_pb2.FunctionDefinition(
    name="get_weather", description="The weather in a city",
    parameters='{"type": "object", "properties": {"city": {"type": "string"}}}'))
REST_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture()
def stub(gateway):
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def auth(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def chat(*turns: tuple[str, str]) -> inference_pb2.ChatMessages:
    return inference_pb2.ChatMessages(
        messages=[inference_pb2.ChatMessage(role=r, content=c) for r, c in turns])


def test_tokenize_answers_what_rest_and_generate_count(stub, gateway, api_key):
    reply = stub.Tokenize(inference_pb2.TokenizeRequest(prompt="hello"), metadata=auth(api_key),
                          timeout=10)
    assert (reply.count, reply.max_model_len, list(reply.tokens), list(reply.token_strs)) == \
        (5, 128, [ord(c) for c in "hello"], [])
    strs = stub.Tokenize(inference_pb2.TokenizeRequest(prompt="ab", return_token_strs=True),
                         metadata=auth(api_key), timeout=10)
    assert list(strs.token_strs) == ["a", "b"]

    turns = (("system", "be brief"), ("user", "weather in Paris?"))
    with_tools = stub.Tokenize(inference_pb2.TokenizeRequest(chat=chat(*turns), tools=[TOOL]),
                               metadata=auth(api_key), timeout=10)
    rest = httpx.post(gateway.rest_url + "/tokenize", timeout=10,
                      headers={"authorization": f"Bearer {api_key}"},
                      json={"messages": [{"role": r, "content": c} for r, c in turns],
                            "tools": [REST_TOOL]}).json()
    assert list(with_tools.tokens) == rest["tokens"] and with_tools.count == rest["count"]
    plain = stub.Tokenize(inference_pb2.TokenizeRequest(chat=chat(*turns)), metadata=auth(api_key))
    assert plain.count < with_tools.count  # the tools are rendered into the prompt
    generated = list(stub.Generate(inference_pb2.GenerateRequest(  # (with tools: past 128 tokens)
        chat=chat(*turns), sampling=common_pb2.SamplingParams(max_tokens=1)),
        metadata=auth(api_key), timeout=10))
    assert generated[-1].usage.prompt_tokens == plain.count
    no_turn = stub.Tokenize(inference_pb2.TokenizeRequest(chat=chat(*turns), add_generation_prompt=False),
                            metadata=auth(api_key))
    assert no_turn.count == plain.count - len("<assistant>")


def test_detokenize_round_trip(stub, api_key):
    ids = stub.Tokenize(inference_pb2.TokenizeRequest(prompt="round trip"), metadata=auth(api_key)).tokens
    text = stub.Detokenize(inference_pb2.DetokenizeRequest(tokens=ids), metadata=auth(api_key), timeout=10)
    assert text.prompt == "round trip"


@pytest.mark.parametrize("method,request_,needle", [
    ("Tokenize", inference_pb2.TokenizeRequest(prompt=""), "must not be empty"),
    ("Tokenize", inference_pb2.TokenizeRequest(), "exactly one of"),
    ("Tokenize", inference_pb2.TokenizeRequest(chat=inference_pb2.ChatMessages()), "messages"),
    ("Tokenize", inference_pb2.TokenizeRequest(chat=chat(("wizard", "hi"))), "messages[0].role"),
    ("Tokenize", inference_pb2.TokenizeRequest(prompt="hi", tools=[TOOL]), "chat input"),
    ("Tokenize", inference_pb2.TokenizeRequest(chat=chat(("user", "hi")), tools=[inference_pb2.Tool(
        function=inference_pb2.FunctionDefinition(name="f", parameters="{"))]), "not JSON"),
    ("Detokenize", inference_pb2.DetokenizeRequest(tokens=[1, 300]), "outside the vocabulary"),
])
def test_bad_input_is_invalid_argument(stub, api_key, method, request_, needle):
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request_, metadata=auth(api_key), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()


def test_key_model_and_undecodable_bytes(stub, gateway, api_key):
    request = inference_pb2.TokenizeRequest(prompt="a")
    for md in ((), auth("sk-inflight-nope")):
        for call, req in ((stub.Tokenize, request), (stub.Detokenize, inference_pb2.DetokenizeRequest(tokens=[1]))):
            with pytest.raises(grpc.RpcError) as info:
                call(req, metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(inference_pb2.TokenizeRequest(prompt="a", model="gpt-4"), metadata=auth(api_key))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        raw = channel.unary_unary("/inflight.v1.Inference/Tokenize", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\x12\x02\xc3\x28", metadata=auth(api_key), timeout=10)  # prompt not UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in info.value.details()


def test_counted_in_the_requests_window_and_never_queued(stub, redis_url, fake_worker):
    client = redis.Redis.from_url(redis_url)
    _, key = keys.create_key(client, "tenant-t", "tok", requests_per_min=2, tokens_per_min=5,
                             max_inflight=1)
    before = sum(client.xlen(stream_name(p, MODEL)) for p in (0, 1, 2))
    reply, call = stub.Tokenize.with_call(inference_pb2.TokenizeRequest(prompt="x" * 50),
                                          metadata=auth(key), timeout=10)  # 50 > tokens_per_min
    assert reply.count == 50
    initial = dict(call.initial_metadata())
    assert initial["x-ratelimit-remaining-requests"] == "1"
    assert "x-ratelimit-limit-tokens" not in initial  # nothing reserved there
    assert stub.Detokenize(inference_pb2.DetokenizeRequest(tokens=[104]), metadata=auth(key)).prompt == "h"
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(inference_pb2.TokenizeRequest(prompt="x"), metadata=auth(key), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(info.value.trailing_metadata())["retry-after-s"]) >= 1
    assert sum(client.xlen(stream_name(p, MODEL)) for p in (0, 1, 2)) == before
    client.close()


def test_reflection_describes_the_methods(gateway):
    """What grpcurl's ``describe`` reads: the service's methods, from reflection alone."""
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        service = pool.FindServiceByName("inflight.v1.Inference")
        methods = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
        fields = [f.name for f in pool.FindMessageTypeByName("inflight.v1.TokenizeResponse").fields]
    assert methods["Tokenize"] == ("inflight.v1.TokenizeRequest", "inflight.v1.TokenizeResponse")
    assert methods["Detokenize"] == ("inflight.v1.DetokenizeRequest", "inflight.v1.DetokenizeResponse")
    assert fields == ["count", "max_model_len", "tokens", "token_strs"]
