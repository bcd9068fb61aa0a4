"""``/tokenize`` and ``/detokenize`` (issue 45 item 3) against the real gateway and Redis: vLLM's
shapes, the count the chat route itself uses, admission by key and requests/min, never queued."""

from __future__ import annotations

import json

import grpc
import httpx
import redis

from common.redis_keys import stream_name
from tests.gateway.fake_worker import MODEL
from gateway import keys
from protos import inference_pb2, inference_pb2_grpc


def _post(gateway, path: str, key: str | None, body: dict, header: str = "authorization") -> httpx.Response:
    headers = {} if key is None else (
        {"authorization": f"Bearer {key}"} if header == "authorization" else {"x-api-key": key})
    return httpx.post(gateway.rest_url + path, json=body, headers=headers, timeout=10)


def test_prompt_and_messages_count_what_the_generation_routes_count(gateway, api_key):
    r = _post(gateway, "/tokenize", api_key, {"prompt": "hello"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 5, "max_model_len": 128, "tokens": [ord(c) for c in "hello"],
                        "token_strs": None}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    counted = _post(gateway, "/tokenize", api_key, {"messages": messages}).json()
    chat = httpx.post(gateway.rest_url + "/v1/chat/completions", timeout=10,
                      headers={"authorization": f"Bearer {api_key}"},
                      json={"messages": messages, "max_tokens": 1}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"] == len(counted["tokens"])
    no_turn = _post(gateway, "/tokenize", api_key, {"messages": messages, "add_generation_prompt": False})
    assert no_turn.json()["count"] == counted["count"] - len("<assistant>")
    strs = _post(gateway, "/tokenize", api_key, {"prompt": "ab", "return_token_strs": True}, "x-api-key")
    assert strs.json()["token_strs"] == ["a", "b"]


def test_detokenize_round_trip_and_bad_input(gateway, api_key):
    ids = _post(gateway, "/tokenize", api_key, {"prompt": "round trip"}).json()["tokens"]
    assert _post(gateway, "/detokenize", api_key, {"tokens": ids}).json() == {"prompt": "round trip"}
    for path, body, param in [("/detokenize", {"tokens": [1, 300]}, "tokens"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages[0].role")]:
        r = _post(gateway, path, api_key, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert _post(gateway, "/tokenize", api_key, {"prompt": "a", "model": "gpt-4"}).status_code == 404
    assert _post(gateway, "/tokenize", None, {"prompt": "a"}).status_code == 401
    assert _post(gateway, "/detokenize", "sk-inflight-nope", {"tokens": [1]}).status_code == 401


def test_counted_in_the_requests_window_and_never_queued(gateway, redis_url, fake_worker):
    client = redis.Redis.from_url(redis_url)
    _, key = keys.create_key(client, "tenant-t", "tok", requests_per_min=2, tokens_per_min=5,
                             max_inflight=1)
    before = sum(client.xlen(stream_name(p, MODEL)) for p in (0, 1, 2))
    first = _post(gateway, "/tokenize", key, {"prompt": "x" * 50})  # 50 tokens > tokens_per_min
    assert first.status_code == 200 and first.headers["x-ratelimit-remaining-requests"] == "1"
    assert "x-ratelimit-limit-tokens" not in first.headers  # nothing reserved there
    assert _post(gateway, "/detokenize", key, {"tokens": [104]}).status_code == 200
    third = _post(gateway, "/tokenize", key, {"prompt": "x"})
    assert third.status_code == 429 and third.json()["error"]["code"] == "key_rate"
    assert float(third.headers["retry-after"]) > 0
    assert sum(client.xlen(stream_name(p, MODEL)) for p in (0, 1, 2)) == before
    client.close()


def test_documented_in_openapi(gateway):
    paths = httpx.get(gateway.rest_url + "/openapi.json", timeout=10).json()["paths"]
    assert {"/tokenize", "/detokenize"} <= set(paths)
    assert "422" not in paths["/tokenize"]["post"]["responses"]



def test_an_embedding_model_is_tokenized_too(redis_server, api_key, tmp_path):
    """vLLM serves /tokenize and /detokenize for any model with a tokenizer, pooling ones
    too; the generation routes still refuse the embedding model (400 model_not_supported)."""
    from tests.gateway.fake_tokenizer import CharTokenizer
    from tests.gateway.harness import start_gateway

    listed = tmp_path / "models.json"
    listed.write_text(json.dumps({"models": [{"name": "gen", "path": "unused"},
                                             {"name": "emb", "path": "unused", "task": "embed"}]}))
    gw = start_gateway(redis_server.url, models_file=str(listed),
                       tokenizers={"gen": CharTokenizer(), "emb": CharTokenizer(context_length=512)})
    try:
        r = _post(gw, "/tokenize", api_key, {"model": "emb", "prompt": "hi"})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [ord("h"), ord("i")] and r.json()["max_model_len"] == 512
        r = _post(gw, "/detokenize", api_key, {"model": "emb", "tokens": [ord("h"), ord("i")]})
        assert r.status_code == 200 and r.json() == {"prompt": "hi"}, r.text
        r = _post(gw, "/v1/completions", api_key, {"model": "emb", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
        with grpc.insecure_channel(gw.grpc_target) as channel:  # gRPC's Tokenize and Detokenize too
            stub, meta = inference_pb2_grpc.InferenceStub(channel), (("authorization", f"Bearer {api_key}"),)
            reply = stub.Tokenize(inference_pb2.TokenizeRequest(model="emb", prompt="hi"), metadata=meta, timeout=10)
            assert list(reply.tokens) == [ord("h"), ord("i")] and reply.max_model_len == 512
            text = stub.Detokenize(inference_pb2.DetokenizeRequest(model="emb", tokens=reply.tokens),
                                   metadata=meta, timeout=10)
            assert text.prompt == "hi"
    finally:
        gw.stop()
