"""End to end through nginx → gateway → Redis → worker (real SmolLM2) → gRPC link.

Cases from public bug reports of other serving systems are marked with the
behaviour they pin down.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import grpc
import httpx
import openai
import pytest

from stack.clients import grpc_chat_stream, rest_chat_stream
from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.e2e.conftest import wait_all_blocks_free

pytestmark = pytest.mark.e2e

FRANCE = "What is the capital of France?"


def chat(rest_url, key, content, **params):
    body = {"messages": [{"role": "user", "content": content}], **params}
    return httpx.post(f"{rest_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)


def chat_stream_text(rest_url, key, content, **params) -> tuple[list[str], dict | None]:
    body = {"messages": [{"role": "user", "content": content}], "stream": True,
            "stream_options": {"include_usage": True}, **params}
    deltas, usage = [], None
    with httpx.stream("POST", f"{rest_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[6:])
        for choice in chunk["choices"]:
            deltas.append(choice["delta"].get("content") or "")
        usage = chunk.get("usage") or usage
    return deltas, usage


def grpc_generate(address, key, content, **sampling) -> tuple[list[str], inference_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=content)]),
            sampling=common_pb2.SamplingParams(**sampling))
        messages = list(stub.Generate(request, timeout=120, metadata=(("authorization", f"Bearer {key}"),)))
    return [m.text for m in messages], messages[-1]


def test_capital_of_france_names_paris(rest_url, api_key):
    resp = chat(rest_url, api_key, FRANCE, max_tokens=32, temperature=0)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_client_streams_through_nginx(rest_url, api_key):
    client = openai.OpenAI(base_url=f"{rest_url}/v1", api_key=api_key)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True, max_tokens=32,
                                            temperature=0, messages=[{"role": "user", "content": FRANCE}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_first_sse_event_arrives_while_generating(rest_url, api_key):
    body = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "stream": True,
            "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    arrivals = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{rest_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {api_key}"}, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter() - start)
    assert len(arrivals) > 10
    # The first event reached us through nginx long before the last one was produced.
    assert arrivals[0] < arrivals[-1] / 2


def test_gpc_generate_names_paris(grpc_address, api_key):
    texts, last = grpc_generate(grpc_address, api_key, FRANCE, max_tokens=32, temperature=0)
    assert "Paris" in "".join(texts)
    assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert last.usage.completion_tokens >= 1


def test_streamed_equals_non_streamed_with_cjk_and_emoji(rest_url, grpc_address, api_key):
    """Bug class: U+FFFD in streamed deltas when a character spans tokens."""
    prompt = "Write the Japanese word for 'thank you' in Japanese characters, then a smiley emoji."
    full = chat(rest_url, api_key, prompt, max_tokens=48, temperature=0).json()
    text = full["choices"][0]["message"]["content"]
    deltas, _ = chat_stream_text(rest_url, api_key, prompt, max_tokens=48, temperature=0)
    grpc_deltas, _ = grpc_generate(grpc_address, api_key, prompt, max_tokens=48, temperature=0)
    assert "".join(deltas) == text == "".join(grpc_deltas)
    assert all("\ufffd" not in d for d in deltas + grpc_deltas)
    assert any(ord(ch) > 0x2E80 for ch in text), f"expected non-ASCII output, got {text!r}"


@pytest.mark.parametrize("stop", ["of France is", "Par"])
def test_stop_strings_cut_the_same_streamed_and_not(rest_url, grpc_address, api_key, stop):
    """Bug class: stop strings spanning tokens, or ending inside a token, cut differently when streaming."""
    base = chat(rest_url, api_key, FRANCE, max_tokens=32, temperature=0).json()["choices"][0]["message"]["content"]
    assert stop in base  # the premise of the test
    full = chat(rest_url, api_key, FRANCE, max_tokens=32, temperature=0, stop=[stop]).json()
    text = full["choices"][0]["message"]["content"]
    assert text == base[: base.index(stop)]
    assert full["choices"][0]["finish_reason"] == "stop"
    deltas, _ = chat_stream_text(rest_url, api_key, FRANCE, max_tokens=32, temperature=0, stop=[stop])
    assert "".join(deltas) == text
    grpc_deltas, last = grpc_generate(grpc_address, api_key, FRANCE, max_tokens=32, temperature=0, stop=[stop])
    assert "".join(grpc_deltas) == text
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP


def test_max_tokens_edges(rest_url, grpc_address, api_key):
    one = chat(rest_url, api_key, FRANCE, max_tokens=1, temperature=0).json()
    assert one["usage"]["completion_tokens"] == 1
    assert one["choices"][0]["finish_reason"] == "length"
    _, last = grpc_generate(grpc_address, api_key, FRANCE, max_tokens=1, temperature=0)
    assert last.usage.completion_tokens == 1
    for bad in (0, -1):
        resp = chat(rest_url, api_key, FRANCE, max_tokens=bad)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "max_tokens"
    for params in ({"max_tokens": None}, {}):
        resp = chat(rest_url, api_key, "Say hi.", temperature=0, **params)
        assert resp.status_code == 200, resp.text


BAD_SAMPLING = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 10**6),
]


def test_bad_sampling_rejected_and_running_request_unaffected(rest_url, grpc_address, api_key):
    reference = chat(rest_url, api_key, FRANCE, max_tokens=24, temperature=0).json()
    result = {}
    runner = threading.Thread(target=lambda: result.update(
        chat(rest_url, api_key, FRANCE, max_tokens=24, temperature=0).json()))
    runner.start()
    for name, value in BAD_SAMPLING:
        raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], name: value})
        resp = httpx.post(f"{rest_url}/v1/chat/completions", content=raw, timeout=30,
                          headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
        assert resp.status_code == 400, (name, value, resp.text)
        assert "error" in resp.json()
        if name != "top_k" or value < 0 or value > 49152:
            with pytest.raises(grpc.RpcError) as err:
                grpc_generate(grpc_address, api_key, "hi", **{name: value})
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, value)
    runner.join(120)
    assert result["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]


def test_prompt_beyond_context_rejected_then_next_succeeds(rest_url, grpc_address, api_key):
    huge = "hello " * 9000  # > 8192-token context
    resp = chat(rest_url, api_key, huge, max_tokens=8)
    assert resp.status_code == 400, resp.text
    resp = chat(rest_url, api_key, "Say hi.", max_tokens=8190)  # prompt + max_tokens > context
    assert resp.status_code == 400, resp.text
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(grpc_address, api_key, huge, max_tokens=8)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert chat(rest_url, api_key, FRANCE, max_tokens=8, temperature=0).status_code == 200


def test_seeded_sampling_same_alone_and_batched(rest_url, api_key):
    """Bug class: per-request seeds that depend on batch composition."""
    params = {"max_tokens": 24, "temperature": 1.0, "seed": 1234}
    alone = chat(rest_url, api_key, "Tell me a fun fact.", **params).json()["choices"][0]["message"]["content"]

    async def batched():
        others = [rest_chat_stream(rest_url, api_key, f"Story number {i}", max_tokens=24, temperature=1.0,
                                   extra={"seed": i} if i % 2 else None) for i in range(7)]
        mine = rest_chat_stream(rest_url, api_key, "Tell me a fun fact.", max_tokens=24, temperature=1.0,
                                extra={"seed": 1234})
        results = await asyncio.gather(mine, *others)
        return results[0].text

    assert asyncio.run(batched()) == alone


def test_cancel_frees_every_block(stack, rest_url, grpc_address, api_key):
    wait_all_blocks_free(stack)

    async def cancel_rest():
        body = {"messages": [{"role": "user", "content": "Write a very long essay."}], "stream": True,
                "max_tokens": 2000, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{rest_url}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {api_key}"}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break  # generation is running: drop the connection

    async def cancel_grpc():
        task = asyncio.ensure_future(grpc_chat_stream(grpc_address, api_key, "Write a very long essay.",
                                                      max_tokens=2000))
        await asyncio.sleep(1.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_rest())
    wait_all_blocks_free(stack)
    asyncio.run(cancel_grpc())
    wait_all_blocks_free(stack)


def test_logprobs_come_back(rest_url, grpc_address, api_key):
    body = chat(rest_url, api_key, FRANCE, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for item in content:
        assert item["logprob"] <= 0 and len(item["top_logprobs"]) == 2
        # greedy: the sampled token is the most likely one
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"], abs=1e-4)
    assert "".join(item["token"] for item in content).strip() in body["choices"][0]["message"]["content"] + "<|im_end|>"
    joined = b"".join(bytes(item["bytes"]) for item in content).decode()  # raw bytes: no U+FFFD
    assert joined.strip() in body["choices"][0]["message"]["content"] + "<|im_end|>"


@pytest.mark.parametrize("transport", ["grpc", "rest"])
def test_bench_drives_the_stack_over_one_shared_connection(rest_url, grpc_address, api_key, transport):
    """``inflight bench --target stack`` sends all requests of a run on one gRPC channel
    (HTTP/2 streams) or one HTTP client's pool; every request gets exactly its tokens."""
    from bench.targets import stack as stack_target
    from bench.workloads import BenchRequest

    requests = [BenchRequest(f"r{i}", f"Count to {i + 3}.", 3 + i, 0.0) for i in range(4)]
    target = stack_target.StackTarget(transport, rest_url, grpc_address, api_key)
    result = stack_target.run(target, requests, "as-running", 8, "bfloat16")
    assert [r.error for r in result.records] == [None] * 4
    assert [r.output_tokens for r in result.records] == [3, 4, 5, 6]
