"""Two models behind one gateway, through nginx (issue 44 item 8): the default SmolLM2 (a
worker started by the stack) and a small random-weight Llama with its own byte-level BPE
tokenizer (worker/model/tiny_model.py, compose's second model too), a second ``inflight worker``
process serving it as ``tiny-random`` with the alias ``tiny-alias``. The ``openai`` client lists both and streams
from each, each request tokenized by its own model's tokenizer and served by its own worker;
an unknown model is a 404 ``model_not_found`` (Anthropic's shape on /v1/messages) with nothing
reserved or queued, NOT_FOUND over gRPC."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from common.model_files import resolve_model_path
from common.promtext import sample_sum
from common.served_model import DEFAULT_SERVED_NAME
from common.tokenizer import load_tokenizer
from gateway import keys
from gateway.admission.ratelimit import window_usage
from gateway.admission.validation import with_bos
from protos import inference_pb2, inference_pb2_grpc
from stack.edge import nginx_binary
from stack.stack import Stack, StackSettings
from tests.helpers.redis_server import free_port, start_redis
from worker.model.tiny_model import write_tiny_model

TINY, ALIAS = "tiny-random", "tiny-alias"
PROMPT = "Serving many models behind one gateway"


@pytest.fixture(scope="module")
def two_models():
    """(stack, tiny model folder, tiny worker's metrics URL): one gateway configured with both
    models, the stack's SmolLM2 worker, and a worker of the tiny model, all behind nginx."""
    if nginx_binary() is None:
        pytest.skip("nginx is not installed")
    server = start_redis()
    run_dir = Path(tempfile.mkdtemp(prefix="inflight-two-models-"))
    folder = write_tiny_model(run_dir / TINY)
    settings = StackSettings(
        run_dir=run_dir, redis_url=server.url, rest_port=free_port(), grpc_port=free_port(), link_port=free_port(),
        worker_health_port=free_port(), worker_grpc_health_port=free_port(), edge_rest_port=free_port(),
        edge_grpc_port=free_port(), edge_overrides={"ip_rate": 1000, "ip_burst": 1000, "key_rate": 1000, "key_burst": 1000},
        gateway_args=("--model", f"{DEFAULT_SERVED_NAME}=smollm2", "--model", f"{TINY}={folder}"),
        worker_args=("--device", "cpu", "--dtype", "float32", "--kv-cache-mib", "64", "--warmup-tokens", "16"))
    stack = Stack(settings)
    tiny_health = free_port()
    tiny = None
    try:
        stack.start()
        log = open(run_dir / "worker-tiny.log", "ab")
        tiny = subprocess.Popen(
            [sys.executable, "-m", "inflight.cli", "worker", "--redis-url", server.url, "--model", str(folder),
             "--served-model-name", TINY, ALIAS, "--health-port", str(tiny_health), "--grpc-health-port",
             str(free_port()), "--link-secret-file", str(stack.link_secret_file), "--worker-id", "tiny-1",
             "--device", "cpu", "--dtype", "float32", "--num-blocks", "64", "--warmup-tokens", "16"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        key = stack.create_key(tenant="two-models", name="list")
        rest = stack.endpoints()["rest"]
        deadline = time.monotonic() + 180
        while True:  # the tiny model is listed as served (not scale_from_zero) once its worker is ready
            assert tiny.poll() is None, (run_dir / "worker-tiny.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the tiny model's worker did not become ready"
            cards = httpx.get(f"{rest}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
            if any(c["id"] == TINY and not c["scale_from_zero"] for c in cards["data"]):
                break
            time.sleep(0.5)
        yield stack, folder, f"http://127.0.0.1:{tiny_health}/metrics"
    finally:
        if tiny is not None:
            tiny.terminate()
            try:
                tiny.wait(30)
            except subprocess.TimeoutExpired:
                tiny.kill()
        stack.stop()
        server.stop()


def _generated(metrics_url: str) -> float:
    return sample_sum(httpx.get(metrics_url, timeout=10).text, "inflight_generation_tokens_total")


def _stream(client, model: str) -> tuple[str, int, int, set[str]]:
    """(text, prompt tokens, completion tokens, the chunks' model names) of a streamed completion."""
    text, usage, names = "", None, set()
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=6, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        names.add(chunk.model)
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    return text, usage.prompt_tokens, usage.completion_tokens, names


def test_openai_client_lists_both_models_and_streams_from_each_with_its_own_tokenizer(two_models):
    openai = pytest.importorskip("openai")
    stack, folder, tiny_metrics = two_models
    key = stack.create_key(tenant="two-models", name="openai")
    client = openai.OpenAI(base_url=stack.endpoints()["rest"] + "/v1", api_key=key, max_retries=0)

    cards = {m.id: m for m in client.models.list()}
    assert {DEFAULT_SERVED_NAME, TINY, ALIAS} <= set(cards)
    assert cards[TINY].model_extra["max_model_len"] == 512 and not cards[TINY].model_extra["scale_from_zero"]
    assert cards[DEFAULT_SERVED_NAME].model_extra["max_model_len"] == 8192
    assert cards[ALIAS].model_extra["root"] == TINY and cards[TINY].owned_by == "inflight"

    smol_tok, tiny_tok = load_tokenizer(resolve_model_path(None)), load_tokenizer(folder)
    smol_ids, tiny_ids = with_bos(smol_tok, smol_tok.encode(PROMPT)), with_bos(tiny_tok, tiny_tok.encode(PROMPT))
    assert len(smol_ids) != len(tiny_ids)  # the two tokenizers differ: the counts below say which one ran

    default_metrics = stack.endpoints()["worker_metrics"]
    before = {"smol": _generated(default_metrics), "tiny": _generated(tiny_metrics)}
    text, prompt_tokens, completion_tokens, names = _stream(client, DEFAULT_SERVED_NAME)
    assert (prompt_tokens, completion_tokens, names) == (len(smol_ids), 6, {DEFAULT_SERVED_NAME}) and text
    text, prompt_tokens, completion_tokens, names = _stream(client, TINY)
    assert (prompt_tokens, completion_tokens, names) == (len(tiny_ids), 6, {TINY}) and text
    text, prompt_tokens, _, names = _stream(client, ALIAS)  # an alias: the same model's stream and worker
    assert (prompt_tokens, names) == (len(tiny_ids), {ALIAS})
    # each model's tokens came from its own worker
    assert _generated(default_metrics) - before["smol"] == 6
    assert _generated(tiny_metrics) - before["tiny"] == 12

    chat = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          extra_body={"ignore_eos": True})
    rendered = tiny_tok.encode(tiny_tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                            add_generation_prompt=True))
    assert chat.model == TINY and chat.usage.prompt_tokens == len(rendered)


def _queued(client: redis.Redis) -> dict[str, int]:
    return {k.decode(): client.xlen(k) for k in client.scan_iter(match="inflight:requests:*")}


def test_an_unknown_model_is_404_with_nothing_reserved_or_queued_and_not_found_over_grpc(two_models):
    openai = pytest.importorskip("openai")
    stack, _, _ = two_models
    client = redis.Redis.from_url(stack.redis_url)
    key_id, key = keys.create_key(client, "two-models", "limited", requests_per_min=100, tokens_per_min=100_000)
    rest, auth = stack.endpoints()["rest"], {"Authorization": f"Bearer {key}"}
    before_usage, before_queued = window_usage(client, key_id), _queued(client)

    expected = {"message": "The model `nope` does not exist or you do not have access to it.",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    bodies = {"/v1/chat/completions": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
              "/v1/completions": {"model": "nope", "prompt": "hi"},
              "/v1/responses": {"model": "nope", "input": "hi"},
              "/tokenize": {"model": "nope", "prompt": "hi"}}
    for path, body in bodies.items():
        r = httpx.post(rest + path, json=body, headers=auth, timeout=30)
        assert (r.status_code, r.json()) == (404, {"error": expected}), path
    r = httpx.post(rest + "/v1/messages", json={"model": "nope", "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "hi"}]},
                   headers={"x-api-key": key, "anthropic-version": "2023-06-01"}, timeout=30)
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError) as err:
        openai.OpenAI(base_url=rest + "/v1", api_key=key, max_retries=0).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert err.value.code == "model_not_found"

    with grpc.insecure_channel(stack.endpoints()["grpc"]) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        metadata = (("authorization", f"Bearer {key}"),)
        with pytest.raises(grpc.RpcError) as rpc:
            list(stub.Generate(inference_pb2.GenerateRequest(model="nope", prompt="hi"), metadata=metadata, timeout=30))
        assert rpc.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in rpc.value.details()
        listed = {m.id: m for m in stub.ListModels(inference_pb2.ListModelsRequest(), metadata=metadata, timeout=30).models}
        assert {DEFAULT_SERVED_NAME, TINY, ALIAS} <= set(listed) and listed[TINY].context_length == 512
        assert not listed[TINY].scale_from_zero and listed[ALIAS].task == "generate"

    assert window_usage(client, key_id) == before_usage  # nothing counted, reserved or in flight
    assert _queued(client) == before_queued  # nothing queued, no stream made for "nope"
    client.close()
