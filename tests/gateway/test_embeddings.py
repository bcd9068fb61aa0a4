"""``POST /v1/embeddings`` and gRPC ``Embed`` end to end: a real gateway (REST + gRPC), a real
Redis, and a real pooling worker (``WorkerService`` over a :class:`PoolingEngine` on a small
random model, its heartbeat announcing task "embed" as ``--runner pooling`` makes it), driven
by the ``openai`` package's ``embeddings.create`` (float and base64) and a gRPC stub over
loopback.

Each vector must be the one the pooling engine computes for that input on its own (cosine
>= 0.9999), in input order; bad input is a 400 / INVALID_ARGUMENT naming it; a chat request
to the embeddings-only model is a clean 400; the inputs' tokens count in the key's
tokens/min window.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
import time

import grpc
import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
import torch

from common.redis_keys import heartbeat_key, stream_name
from gateway import keys
from protos import inference_pb2, inference_pb2_grpc
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import start_redis
from worker.engine.engine_config import EngineConfig
from worker.engine.engine_types import EngineRequest, PoolingParams
from worker.engine.pooler import PoolerConfig
from worker.engine.pooling_engine import PoolingEngine
from worker.model.model_runner import tiny_random_runner
from worker.serve.main import announcement
from worker.serve.service import WorkerService
from worker.serve.settings import WorkerSettings

MODEL = "emb-model"
HIDDEN = 64
VOCAB = 300  # the gateway's CharTokenizer: one token per character, id = code point % 300


def _runner():
    return tiny_random_runner(seed=3, vocab_size=VOCAB, hidden_size=HIDDEN, num_blocks=64, block_size=16)


def _engine(runner) -> PoolingEngine:
    config = EngineConfig(block_size=16, num_blocks=runner.num_blocks, max_num_batched_tokens=64, max_num_seqs=8)
    return PoolingEngine(runner, None, config, PoolerConfig("MEAN", True))


class PoolingWorker:
    """A pooling ``WorkerService`` on its own thread and loop, with its heartbeat."""

    def __init__(self, redis_url: str):
        self.settings = WorkerSettings(redis_url=redis_url, worker_id="pool-1", poll_ms=20, health_port=0,
                                       grpc_health_port=0, runner="pooling", served_model_name=(MODEL,),
                                       kv_events=False)
        self.engine = _engine(_runner())
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.loop.close()

    async def _serve(self) -> None:
        client = aioredis.Redis.from_url(self.settings.redis_url)
        self.service = WorkerService(self.settings, self.engine, client, MODEL)
        beat = announcement(self.settings, self.engine, time.time(), "").to_json()  # task "embed"
        await client.set(heartbeat_key(self.settings.worker_id), beat, ex=3600)
        self.ready.set()
        try:
            await self.service.run()
        finally:
            await client.delete(heartbeat_key(self.settings.worker_id))
            await client.aclose()

    def start(self) -> "PoolingWorker":
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.service.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def stack():
    server = start_redis()
    gateway = start_gateway(server.url, served_model_name=MODEL)
    worker = PoolingWorker(server.url).start()
    client = redis.Redis.from_url(server.url)
    yield gateway, client
    client.close()
    worker.stop()
    gateway.stop()
    server.stop()
    stats = worker.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every input's KV freed


@pytest.fixture()
def api_key(stack) -> str:
    _, client = stack
    return keys.create_key(client, "tenant-e", "emb")[1]


def _expected(texts: list[str]) -> list[torch.Tensor]:
    """Each text's vector from a pooling engine of the same weights, one input at a time."""
    engine = _engine(_runner())
    out = []
    for i, text in enumerate(texts):
        ids = [ord(c) % VOCAB for c in text]
        assert engine.add_request(EngineRequest(f"x{i}", ids, pooling=PoolingParams())).ok
        while engine.has_unfinished():
            for o in engine.step():
                out.append(torch.tensor(o.values))
    return out


def _cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=0))


def _openai(stack, api_key) -> openai.OpenAI:
    gateway, _ = stack
    return openai.OpenAI(base_url=f"{gateway.rest_url}/v1", api_key=api_key, max_retries=0, timeout=60)


TEXTS = ["hello embeddings", "a rather longer input, so that this batch has inputs of different lengths", "x"]


def test_openai_client_float_in_input_order(stack, api_key):
    result = _openai(stack, api_key).embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in result.data] == [0, 1, 2] and result.model == MODEL
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(t) for t in TEXTS)
    for got, want in zip(result.data, _expected(TEXTS)):
        assert len(got.embedding) == HIDDEN
        assert abs(sum(v * v for v in got.embedding) - 1.0) < 1e-4
        assert _cos(got.embedding, want) >= 0.9999


def test_openai_client_base64_default_matches_float(stack, api_key):
    client = _openai(stack, api_key)
    floats = client.embeddings.create(model=MODEL, input="one input", encoding_format="float").data[0].embedding
    default = client.embeddings.create(model=MODEL, input="one input").data[0].embedding  # the client asks base64
    assert default == pytest.approx(floats, abs=1e-6)
    gateway, _ = stack
    raw = httpx.post(f"{gateway.rest_url}/v1/embeddings", headers={"Authorization": f"Bearer {api_key}"},
                     json={"model": MODEL, "input": "one input", "encoding_format": "base64"}, timeout=60)
    assert raw.status_code == 200, raw.text
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{HIDDEN}f", packed)) == pytest.approx(floats, abs=1e-6)


def test_token_arrays_and_dimensions(stack, api_key):
    client = _openai(stack, api_key)
    ids = [ord(c) for c in "tokens"]
    one = client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data
    many = client.embeddings.create(model=MODEL, input=[ids, ids[:2]], encoding_format="float").data
    assert len(one) == 1 and len(many) == 2
    assert _cos(one[0].embedding, many[0].embedding) >= 0.9999
    assert _cos(one[0].embedding, _expected(["tokens"])[0]) >= 0.9999
    cut = client.embeddings.create(model=MODEL, input="tokens", dimensions=16, encoding_format="float").data[0]
    assert len(cut.embedding) == 16 and abs(sum(v * v for v in cut.embedding) - 1.0) < 1e-4
    assert _cos(cut.embedding, _expected(["tokens"])[0][:16]) >= 0.9999
    raw = client.embeddings.create(model=MODEL, input="tokens", encoding_format="float",
                                   extra_body={"normalize": False}).data[0].embedding  # vLLM's extra
    assert abs(sum(v * v for v in raw) - 1.0) > 1e-2 and _cos(raw, _expected(["tokens"])[0]) >= 0.9999


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", 3]}, "input"),
    ({"input": [5000]}, "input"), ({"input": "y" * 200}, "input"), ({"input": [[]]}, "input"),
    ({"input": "a", "dimensions": 0}, "dimensions"), ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": HIDDEN + 1}, "dimensions"),  # the worker's refusal
    ({"input": "a", "dimensions": 2**32}, "dimensions"),  # above the queue entry's uint32: was a 500
    ({"input": "\ud800"}, "input"), ({"input": ["ok", "a\udfffb"]}, "input"),  # lone surrogates: were 500s
])
def test_bad_input_is_400(stack, api_key, body, param):
    gateway, _ = stack
    r = httpx.post(f"{gateway.rest_url}/v1/embeddings", timeout=60,  # ASCII JSON: "\\ud800" escapes
                   headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
                   content=json.dumps({"model": MODEL, **body}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] != "invalid_request", error
    assert param in error["message"]


def test_too_long_input_says_context_length(stack, api_key):
    with pytest.raises(openai.BadRequestError) as exc:
        _openai(stack, api_key).embeddings.create(model=MODEL, input="z" * 129)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:  # one token array is one input, capped by the context
        _openai(stack, api_key).embeddings.create(model=MODEL, input=[ord("z")] * 3000)
    assert exc.value.code == "context_length_exceeded"


def test_chat_to_the_embeddings_model_is_a_clean_400(stack, api_key):
    """Refused by the gateway's model registry: the model's workers announce task "embed"."""
    with pytest.raises(openai.BadRequestError) as exc:
        _openai(stack, api_key).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 400 and exc.value.code == "model_not_supported"


def test_unknown_model_is_404(stack, api_key):
    with pytest.raises(openai.NotFoundError):
        _openai(stack, api_key).embeddings.create(model="no-such-model", input="a")


def test_input_tokens_count_in_the_key_token_window(stack):
    _, client = stack
    key = keys.create_key(client, "tenant-t", "small", tokens_per_min=30)[1]
    gateway, _ = stack
    openai_client = openai.OpenAI(base_url=f"{gateway.rest_url}/v1", api_key=key, max_retries=0, timeout=60)
    openai_client.embeddings.create(model=MODEL, input=["x" * 10, "y" * 10])  # 20 of 30 tokens
    with pytest.raises(openai.RateLimitError):
        openai_client.embeddings.create(model=MODEL, input="z" * 15)  # 35 > 30 within the minute


def _stub(stack):
    gateway, _ = stack
    channel = grpc.insecure_channel(gateway.grpc_target)
    return channel, inference_pb2_grpc.InferenceStub(channel)


def test_grpc_embed_texts_and_tokens(stack, api_key):
    channel, stub = _stub(stack)
    meta = (("authorization", f"Bearer {api_key}"),)
    with channel:
        answer = stub.Embed(inference_pb2.EmbedRequest(model=MODEL, texts=TEXTS), metadata=meta, timeout=60)
        assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == MODEL
        assert answer.prompt_tokens == sum(len(t) for t in TEXTS)
        for got, want in zip(answer.data, _expected(TEXTS)):
            assert _cos(list(got.values), want) >= 0.9999
        ids = inference_pb2.TokenIds(ids=[ord(c) for c in "tokens"])
        cut = stub.Embed(inference_pb2.EmbedRequest(token_inputs=[ids], dimensions=16), metadata=meta, timeout=60)
        assert len(cut.data[0].values) == 16
        assert _cos(list(cut.data[0].values), _expected(["tokens"])[0][:16]) >= 0.9999


@pytest.mark.parametrize("request_, code", [
    (inference_pb2.EmbedRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (inference_pb2.EmbedRequest(texts=["a"], token_inputs=[inference_pb2.TokenIds(ids=[1])]),
     grpc.StatusCode.INVALID_ARGUMENT),
    (inference_pb2.EmbedRequest(texts=[""]), grpc.StatusCode.INVALID_ARGUMENT),
    (inference_pb2.EmbedRequest(token_inputs=[inference_pb2.TokenIds(ids=[4000])]), grpc.StatusCode.INVALID_ARGUMENT),
    (inference_pb2.EmbedRequest(model="nope", texts=["a"]), grpc.StatusCode.NOT_FOUND),
])
def test_grpc_embed_bad_input(stack, api_key, request_, code):
    channel, stub = _stub(stack)
    with channel, pytest.raises(grpc.RpcError) as exc:
        stub.Embed(request_, metadata=(("authorization", f"Bearer {api_key}"),), timeout=60)
    assert exc.value.code() == code


def test_grpc_embed_needs_a_key(stack):
    channel, stub = _stub(stack)
    with channel, pytest.raises(grpc.RpcError) as exc:
        stub.Embed(inference_pb2.EmbedRequest(texts=["a"]), timeout=60)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def idle_stack():
    """A gateway whose embeddings model has a ready worker's heartbeat but nobody reading its
    stream: every entry stays queued."""
    server = start_redis()
    gateway = start_gateway(server.url, served_model_name=MODEL)
    client = redis.Redis.from_url(server.url)
    settings = WorkerSettings(worker_id="idle-1", runner="pooling", served_model_name=(MODEL,))
    client.set(heartbeat_key("idle-1"), announcement(settings, _engine(_runner()), time.time(), "").to_json(), ex=3600)
    yield gateway, client
    client.close()
    gateway.stop()
    server.stop()


def _queued(client) -> int:
    return sum(client.xlen(stream_name(p, MODEL)) for p in range(3))


def _until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_leaves_takes_its_entries_and_slot_with_it(idle_stack):
    gateway, client = idle_stack
    key_id, key = keys.create_key(client, "tenant-idle", "idle", max_inflight=1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.rest_url}/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL, "input": ["a", "b", "c"]}, timeout=1.5)
    assert _until(lambda: _queued(client) == 0), "the three entries stayed queued"
    assert _until(lambda: client.zcard(f"inflight:rl:{{{key_id}}}:inflight") == 0), "the in-flight slot stayed"
    channel, stub = _stub(idle_stack)
    with channel, pytest.raises(grpc.RpcError) as exc:  # the slot is free again: admitted, then its deadline
        stub.Embed(inference_pb2.EmbedRequest(texts=["a", "b"]), metadata=(("authorization", f"Bearer {key}"),),
                   timeout=1.5)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _until(lambda: _queued(client) == 0), "a gRPC client past its deadline left its entries queued"


def test_loading_a_lora_adapter_for_the_embeddings_model_is_a_prompt_400(stack):
    """Pooling workers serve no adapters: the admin endpoint says so at once (the new-user trial
    waited 30 s for a 504)."""
    gateway, client = stack
    _, admin = keys.create_key(client, "ops", "admin", admin=True)
    r = httpx.post(f"{gateway.rest_url}/v1/load_lora_adapter", headers={"Authorization": f"Bearer {admin}"},
                   json={"lora_name": "sql", "lora_path": "/adapters/sql"}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text


def test_a_stored_out_of_range_priority_is_served(stack):
    """A key record with priority 7 (written before `inflight keys` checked it) is queued in
    class 2, which the workers read, not in a stream none reads (where it waited forever)."""
    gateway, client = stack
    _, key = keys.create_key(client, "t", "old record")
    client.hset("inflight:keys:hash:" + keys.hash_key(key), "priority", "7")
    r = httpx.post(f"{gateway.rest_url}/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL, "input": "hi"}, timeout=60)  # the timeout only guards a hang
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
    assert client.xlen(stream_name(7, MODEL)) == 0
