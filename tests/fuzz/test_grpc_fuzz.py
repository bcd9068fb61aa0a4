"""Hypothesis-generated gRPC requests against the gateway's real
``inflight.v1.Inference`` server (private Redis, fake worker on the real link).

Field values go to the edges protobuf allows: NaN/inf/huge/denormal floats, the
extremes of every integer type, giant ``max_tokens``/``logprobs``/``priority``,
huge stop and stop-token lists, empty messages, unknown roles and model names,
long and odd ``request_id``s, and raw bytes that are not a valid message at all
(corrupt wire data, strings that are not UTF-8). Properties: the status is OK or
one of ``ALLOWED``, never UNKNOWN/INTERNAL; every call ends within
``CALL_TIMEOUT_S``; a well-formed request between the fuzzed ones (every 5th) and
after them still streams its tokens.
"""

from __future__ import annotations

import itertools

import grpc
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from protos import common_pb2, inference_pb2
from tests.fuzz.conftest import CALL_TIMEOUT_S, FUZZ, scripted
from tests.fuzz.probes import assert_grpc_still_works, assert_worker_would_accept

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED,
           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION}
PROBE_EVERY = 5
GENERATE = "/inflight.v1.Inference/Generate"
LIST_MODELS = "/inflight.v1.Inference/ListModels"

# protobuf strings must be valid Unicode on the client (lone surrogates are refused
# there); invalid UTF-8 on the wire is covered by the raw-bytes test below.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)
FLOATS = st.floats() | st.sampled_from([0.0, -0.0, 1e-45, 1e-320, 3.4e38, 3.5e38, 1e308, -1.0, 2.0])
UINT32 = st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 2**31, 2**32 - 1])
INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "robot", "", "USER"]) | TEXT
AUTH = st.sampled_from(["a", "a", "a", "b", None, "basic", "unknown", "revoked"])


def optional(strategy):
    """``strategy`` or None (the field left unset)."""
    return st.none() | strategy


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    """SamplingParams with any field values the wire types allow."""
    params = common_pb2.SamplingParams(
        max_tokens=draw(UINT32 | st.integers(0, 8)), stop=draw(st.lists(TEXT, max_size=40)),
        stop_token_ids=draw(st.lists(UINT32 | st.integers(0, 400), max_size=100)),
        ignore_eos=draw(st.booleans()), logprobs=draw(UINT32 | st.integers(0, 25)),
        return_logprobs=draw(st.booleans()), skip_special_tokens=draw(st.booleans()),
        n=draw(UINT32 | st.integers(0, 20)))
    for name, strategy in (("temperature", FLOATS), ("top_p", FLOATS), ("top_k", INT32), ("seed", INT64)):
        value = draw(optional(strategy))
        if value is not None:
            setattr(params, name, value)  # float fields round to float32 (1e308 -> inf)
    return params


@st.composite
def generate_requests(draw) -> inference_pb2.GenerateRequest:
    """GenerateRequest: no input, a prompt or chat messages; any model, priority and id."""
    request = inference_pb2.GenerateRequest(
        model=draw(st.sampled_from(["", "test-model", "gpt-4o"]) | TEXT),
        request_id=draw(st.just("") | TEXT | st.text(min_size=120, max_size=5000)))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling()))
    source = draw(st.sampled_from(["none", "prompt", "chat", "empty-chat"]))
    if source == "prompt":
        request.prompt = draw(TEXT | st.text(min_size=100, max_size=20_000))
    elif source == "chat":
        messages = draw(st.lists(st.tuples(ROLES, TEXT), max_size=8))
        request.chat.messages.extend(inference_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    elif source == "empty-chat":
        request.chat.SetInParent()
    priority = draw(optional(UINT32))
    if priority is not None:
        request.priority = priority
    return request


def metadata(kind: str | None, tenants: dict[str, str]) -> tuple:
    """gRPC metadata carrying the ``authorization`` of ``kind`` (None = no entry)."""
    value = {None: None, "a": f"Bearer {tenants['a']}", "b": f"Bearer {tenants['b']}",
             "basic": "Basic dXNlcjpwYXNzd29yZA==", "unknown": "Bearer sk-inflight-not-a-key",
             "revoked": f"Bearer {tenants['revoked']}"}[kind]
    return () if value is None else (("authorization", value),)


def call_status(call) -> grpc.StatusCode:
    """Drain a server-streaming call; its final status code."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.fixture()
def channel(fuzz_gateway):
    with grpc.insecure_channel(fuzz_gateway.grpc_target) as ch:
        yield ch


def test_fuzzed_generate_requests(channel, tenants, fuzz_worker):
    counter = itertools.count(1)
    generate = channel.unary_stream(GENERATE, request_serializer=inference_pb2.GenerateRequest.SerializeToString,
                                    response_deserializer=inference_pb2.GenerateResponse.FromString)

    @FUZZ
    @given(request=generate_requests(), auth=AUTH)
    def run(request, auth):
        assume(not scripted(str(request)))
        queued = len(fuzz_worker.requests)
        status = call_status(generate(request, metadata=metadata(auth, tenants), timeout=CALL_TIMEOUT_S))
        assert status in ALLOWED, (status, request)
        assert_worker_would_accept(fuzz_worker.requests[queued:])
        if status is grpc.StatusCode.OK:
            assert auth in ("a", "b"), f"served without a valid key: {auth}"
        if next(counter) % PROBE_EVERY == 0:
            assert_grpc_still_works(channel, tenants["a"])

    run()
    for tenant in ("a", "b"):
        assert_grpc_still_works(channel, tenants[tenant])


def corrupt(valid: bytes, data) -> bytes:
    """``valid`` with a few bytes overwritten, cut short or extended."""
    raw = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 4))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    return bytes(raw[:data.draw(st.integers(0, len(raw)))]) + data.draw(st.binary(max_size=8))


NOT_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"hi\x80"])


@st.composite
def raw_messages(draw) -> bytes:
    """Bytes on the wire: arbitrary, a corrupted valid request, or a valid request whose
    prompt / role / stop string is not UTF-8 (field tags from protos/*.proto)."""
    kind = draw(st.sampled_from(["arbitrary", "corrupted", "bad-utf8"]))
    if kind == "arbitrary":
        return draw(st.binary(max_size=200))
    valid = inference_pb2.GenerateRequest(
        prompt="hello", sampling=common_pb2.SamplingParams(max_tokens=3)).SerializeToString()
    if kind == "corrupted":
        return corrupt(valid, draw(st.data()))
    bad = draw(NOT_UTF8)
    prompt = b"\x12" + bytes([len(bad)]) + bad                     # GenerateRequest.prompt = 2
    role = b"\x0a" + bytes([len(bad)]) + bad                       # ChatMessage.role = 1
    chat = b"\x1a" + bytes([len(role) + 2]) + b"\x0a" + bytes([len(role)]) + role  # chat = 3
    stop = b"\x32" + bytes([len(bad)]) + bad                       # SamplingParams.stop = 6
    sampling_ = b"\x22" + bytes([len(stop)]) + stop                # GenerateRequest.sampling = 4
    return draw(st.sampled_from([prompt, chat, b"\x12\x02hi" + sampling_, b"\x32" + bad]))


def test_undecodable_bytes_are_invalid_argument(channel, tenants, fuzz_worker):
    """Regression: a request that is not a valid message (e.g. a string field that is not
    UTF-8) was answered UNKNOWN by grpc's deserializer; now INVALID_ARGUMENT."""
    identity = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    generate = channel.unary_stream(GENERATE, **identity)
    list_models = channel.unary_unary(LIST_MODELS, **identity)
    meta = metadata("a", tenants)
    for payload in (b"\x12\x03\xff\xfe\xfd", b"\xff\xff\xff\xff", b"\x0a\x02\xc3\x28"):
        with pytest.raises(grpc.RpcError) as info:
            list(generate(payload, metadata=meta, timeout=CALL_TIMEOUT_S))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "not a valid message" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list_models(b"\xff\xff", metadata=meta, timeout=CALL_TIMEOUT_S)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    counter = itertools.count(1)

    @FUZZ
    @given(payload=raw_messages())
    def run(payload):
        assume(not scripted(payload.decode("latin-1")))
        queued = len(fuzz_worker.requests)
        status = call_status(generate(payload, metadata=meta, timeout=CALL_TIMEOUT_S))
        assert status in ALLOWED, (status, payload)
        assert_worker_would_accept(fuzz_worker.requests[queued:])
        if next(counter) % PROBE_EVERY == 0:
            assert_grpc_still_works(channel, tenants["a"])

    run()
    assert_grpc_still_works(channel, tenants["a"])


TOKENIZE = "/inflight.v1.Inference/Tokenize"
DETOKENIZE = "/inflight.v1.Inference/Detokenize"


@st.composite
def tokenizer_calls(draw) -> tuple[str, object]:
    """A ``Tokenize`` (no input, a prompt, chat messages or an empty chat; any model and
    flags) or a ``Detokenize`` (any uint32 ids) request, with its method path."""
    if draw(st.booleans()):
        return DETOKENIZE, inference_pb2.DetokenizeRequest(
            model=draw(st.sampled_from(["", "test-model", "gpt-4o"])),
            tokens=draw(st.lists(UINT32 | st.integers(0, 400), max_size=50)))
    request = inference_pb2.TokenizeRequest(
        model=draw(st.sampled_from(["", "", "test-model", "gpt-4o"]) | TEXT),
        return_token_strs=draw(st.booleans()))
    source = draw(st.sampled_from(["none", "prompt", "prompt", "chat", "empty-chat"]))
    if source == "prompt":
        request.prompt = draw(TEXT | st.text(min_size=100, max_size=20_000))
    elif source == "chat":
        messages = draw(st.lists(st.tuples(ROLES, TEXT), max_size=8))
        request.chat.messages.extend(inference_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    elif source == "empty-chat":
        request.chat.SetInParent()
    for name in ("add_special_tokens", "add_generation_prompt"):
        flag = draw(optional(st.booleans()))
        if flag is not None:
            setattr(request, name, flag)
    return TOKENIZE, request


def test_fuzzed_tokenizer_calls(channel, tenants, fuzz_worker):
    """gRPC Tokenize/Detokenize: OK or an allowed status, never UNKNOWN/INTERNAL; OK only
    with a valid key, with ``count`` the number of ``tokens``; nothing is queued."""
    serialize = dict(request_serializer=lambda r: r.SerializeToString())
    calls = {TOKENIZE: channel.unary_unary(TOKENIZE, **serialize,
                                           response_deserializer=inference_pb2.TokenizeResponse.FromString),
             DETOKENIZE: channel.unary_unary(DETOKENIZE, **serialize,
                                             response_deserializer=inference_pb2.DetokenizeResponse.FromString)}
    queued = len(fuzz_worker.requests)

    @FUZZ
    @given(call=tokenizer_calls(), auth=AUTH)
    def run(call, auth):
        method, request = call
        try:
            reply = calls[method](request, metadata=metadata(auth, tenants), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            assert err.code() in ALLOWED, (err.code(), err.details(), request)
            return
        assert auth in ("a", "b"), f"served without a valid key: {auth}"
        if method == TOKENIZE:
            assert reply.count == len(reply.tokens) and reply.max_model_len == 128

    run()
    assert len(fuzz_worker.requests) == queued
    assert calls[TOKENIZE](inference_pb2.TokenizeRequest(prompt="hi"), metadata=metadata("a", tenants),
                           timeout=CALL_TIMEOUT_S).tokens == [ord("h"), ord("i")]
    assert_grpc_still_works(channel, tenants["a"])
