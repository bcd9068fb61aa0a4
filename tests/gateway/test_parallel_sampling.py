"""Parallel sampling (``n`` > 1) through the real gateway and the fake worker, which
interleaves the choices' deltas (each with its ``index``) and sends one ``Finished`` per
choice (tests/gateway/fake_worker.py): choice ``i`` > 0 says ``"w{j}.{i} "``, odd choices
one piece fewer. Responses are parsed with the ``openai`` package's models."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest
import redis
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway import keys
from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.gateway.conftest import wait_for
from tests.gateway.test_openai_shapes import _check
from tests.helpers.sse import sse_data

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"prompt": "hello", "max_tokens": 3}  # 5 prompt tokens (CharTokenizer)


def _post(gateway, path, body, key):
    return httpx.post(gateway.rest_url + path, json=body, timeout=10,
                      headers={"Authorization": f"Bearer {key}"})


def _chunks(response) -> list[dict]:
    assert response.status_code == 200, response.text
    frames = ["data: " + d for d in sse_data(response.text)]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def _texts(n: int, max_tokens: int = 3) -> list[str]:
    """What the fake worker's choices say (see the module docstring)."""
    out = []
    for i in range(n):
        count = max_tokens if i == 0 else max(1, max_tokens - i % 2)
        out.append("".join(f"w{j}" + (f".{i}" if i else "") + " " for j in range(count)))
    return out


def test_chat_non_stream_has_n_choices_and_summed_usage(gateway, api_key, fake_worker):
    r = _post(gateway, "/v1/chat/completions", {**CHAT, "n": 3}, api_key)
    assert r.status_code == 200, r.text
    body = r.json()
    _check(ChatCompletion, body)
    parsed = ChatCompletion.model_validate(body)
    assert [c.index for c in parsed.choices] == [0, 1, 2]
    assert [c.message.content for c in parsed.choices] == _texts(3)
    assert [c.finish_reason for c in parsed.choices] == ["length", "stop", "length"]
    prompt = parsed.usage.prompt_tokens
    assert parsed.usage.completion_tokens == 3 + 2 + 3  # summed over the choices
    assert parsed.usage.total_tokens == prompt + 8
    # cached tokens once: choice 0's (the siblings report the shared prompt blocks)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0
    queued = next(q for q in fake_worker.requests if q.request_id == r.headers["x-request-id"])
    assert queued.sampling.n == 3


def test_completion_non_stream_with_logprobs_per_choice(gateway, api_key):
    r = _post(gateway, "/v1/completions", {**COMPLETION, "n": 2, "logprobs": 0}, api_key)
    assert r.status_code == 200, r.text
    body = r.json()
    _check(Completion, body)
    parsed = Completion.model_validate(body)
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [
        (0, "w0 w1 w2 ", "length"), (1, "w0.1 w1.1 ", "stop")]
    assert parsed.choices[0].logprobs.token_logprobs == [-0.25] * 3
    assert parsed.choices[1].logprobs.token_logprobs == [-1.25] * 2
    assert parsed.choices[1].logprobs.tokens == ["w0.1 ", "w1.1 "]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_logprobs_per_choice(gateway, api_key):
    r = _post(gateway, "/v1/chat/completions", {**CHAT, "n": 2, "logprobs": True}, api_key)
    parsed = ChatCompletion.model_validate(r.json())
    assert [[t.logprob for t in c.logprobs.content] for c in parsed.choices] == [[-0.25] * 3, [-1.25] * 2]


def test_chat_stream_interleaves_choices_with_a_role_chunk_and_finish_each(gateway, api_key):
    body = {**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _chunks(_post(gateway, "/v1/chat/completions", body, api_key))
    for c in chunks:
        _check(ChatCompletionChunk, c)
    *per_choice, last = chunks
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in per_choice)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert last["usage"]["prompt_tokens"] == ChatCompletion.model_validate(
        _post(gateway, "/v1/chat/completions", CHAT, api_key).json()).usage.prompt_tokens
    indexes = [c["choices"][0]["index"] for c in per_choice]
    assert indexes[:3] == [0, 1, 2]  # each choice's role chunk first
    assert indexes[3:6] == [0, 1, 2]  # then the choices' deltas interleaved, step by step
    for i, text in enumerate(_texts(3)):
        mine = [c["choices"][0] for c in per_choice if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(ch["delta"].get("content", "") for ch in mine) == text
        assert [ch["finish_reason"] for ch in mine][-1] in ("stop", "length")
        assert mine[-1]["delta"] == {} and all(ch["finish_reason"] is None for ch in mine[:-1])


def test_completion_stream_has_each_index_and_one_usage_chunk(gateway, api_key):
    body = {**COMPLETION, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _chunks(_post(gateway, "/v1/completions", body, api_key))
    for c in chunks:
        _check(Completion, c)
    usage_chunks = [c for c in chunks if c["usage"] is not None]
    assert usage_chunks == [chunks[-1]] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in chunks[:-1] if c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "stop"}
    texts = ["".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i)
             for i in range(2)]
    assert texts == _texts(2)


def test_continuous_usage_counts_every_choice(gateway, api_key):
    body = {**COMPLETION, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _chunks(_post(gateway, "/v1/completions", body, api_key))
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 5 and completion[-2] == 5


def test_openai_client_gets_n_choices(gateway, api_key):
    client = openai.OpenAI(base_url=gateway.rest_url + "/v1", api_key=api_key, max_retries=0, timeout=10)
    chat = client.chat.completions.create(model="test-model", max_tokens=3, n=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert [c.message.content for c in chat.choices] == _texts(4)
    stream = list(client.chat.completions.create(
        model="test-model", max_tokens=3, n=2, messages=[{"role": "user", "content": "hi"}],
        stream=True))
    got: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            got[choice.index] = got.get(choice.index, "") + (choice.delta.content or "")
    assert got == {0: _texts(2)[0], 1: _texts(2)[1]}
    completion = client.completions.create(model="test-model", prompt="hello", max_tokens=2, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert completion.usage.completion_tokens == 2 + 1 + 2


def test_n_above_the_cap_is_a_400_naming_n(gateway, api_key):
    r = _post(gateway, "/v1/chat/completions", {**CHAT, "n": 17}, api_key)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "[1, 16]" in r.json()["error"]["message"]
    assert _post(gateway, "/v1/chat/completions", {**CHAT, "n": 16}, api_key).status_code == 200


def test_the_cap_is_a_setting(redis_server):
    from tests.gateway.harness import start_gateway
    gw = start_gateway(redis_server.url, max_n=2)
    try:
        client = redis.Redis.from_url(redis_server.url)
        _, key = keys.create_key(client, "tenant-n", "cap")
        client.close()
        r = _post(gw, "/v1/completions", {**COMPLETION, "n": 3}, key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert "[1, 2]" in r.json()["error"]["message"]
    finally:
        gw.stop()


def test_admission_charges_each_choice(gateway, api_key, redis_url):
    """prompt + n × max_tokens: 30 tokens/min admit prompt 5 + 5 (n=1), refunded to its real
    usage (10), but not then 5 + 4 × 5 = 25 on top of it; the refund after an n > 1 request
    is its summed usage."""
    client = redis.Redis.from_url(redis_url)
    _, key = keys.create_key(client, "tenant-tpm", "n", tokens_per_min=30)
    _, roomy = keys.create_key(client, "tenant-tpm2", "n", tokens_per_min=100)
    client.close()
    body = {"prompt": "hello", "max_tokens": 5}
    assert _post(gateway, "/v1/completions", body, key).status_code == 200
    refused = _post(gateway, "/v1/completions", {**body, "n": 4}, key)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "key_tokens", refused.text
    assert _post(gateway, "/v1/completions", body, key).status_code == 200  # 10 + 10 <= 30
    # the cost alone above the key's tokens/min is a 400, never worth a retry
    alone = _post(gateway, "/v1/completions", {**body, "n": 6}, key)  # 5 + 30 > 30
    assert alone.status_code == 400, alone.text
    # refund from real usage: n=3 costs 5 + 15 = 20 and uses 5 + (5 + 4 + 5) = 19
    first = _post(gateway, "/v1/completions", {**body, "n": 3}, roomy)
    assert first.json()["usage"]["total_tokens"] == 19
    assert first.headers["x-ratelimit-remaining-tokens"] == "80"
    second = _post(gateway, "/v1/completions", body, roomy)
    assert second.headers["x-ratelimit-remaining-tokens"] == str(100 - 19 - 10)


def _auth(key):
    return (("authorization", f"Bearer {key}"),)


def test_grpc_streams_interleaved_choices_with_their_index(gateway, api_key):
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        req = inference_pb2.GenerateRequest(prompt="hello", sampling=common_pb2.SamplingParams(
            max_tokens=3, n=3))
        replies = list(stub.Generate(req, metadata=_auth(api_key), timeout=10))
    assert [r.index for r in replies[:3]] == [0, 1, 2]
    for i, text in enumerate(_texts(3)):
        mine = [r for r in replies if r.index == i]
        assert "".join(r.text for r in mine) == text
        assert mine[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        assert mine[-1].usage.prompt_tokens == 5
        assert mine[-1].usage.completion_tokens == len(text.split())
    assert sum(r.usage.completion_tokens for r in replies) == 8


def test_grpc_n_above_the_cap_is_invalid_argument(gateway, api_key):
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(inference_pb2.GenerateRequest(
                prompt="hi", sampling=common_pb2.SamplingParams(n=17)), metadata=_auth(api_key)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cancel_is_one_cancel_for_the_whole_request(gateway, api_key, fake_worker):
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(inference_pb2.GenerateRequest(
            prompt="slow", request_id="cancel-n", sampling=common_pb2.SamplingParams(n=3)),
            metadata=_auth(api_key))
        first = next(call)
        assert first.index == 0
        call.cancel()
    assert wait_for(lambda: any(c.endswith(":cancel-n") for c in fake_worker.cancels))
    assert len([c for c in fake_worker.cancels if c.endswith(":cancel-n")]) == 1


def test_rest_disconnect_cancels_the_whole_request(gateway, api_key, fake_worker):
    with httpx.stream("POST", gateway.rest_url + "/v1/completions", timeout=10,
                      json={"prompt": "slow", "n": 2, "stream": True},
                      headers={"Authorization": f"Bearer {api_key}"}) as r:
        rid = r.headers["x-request-id"]
        next(r.iter_lines())
    assert wait_for(lambda: rid in fake_worker.cancels)
    assert fake_worker.cancels.count(rid) == 1
