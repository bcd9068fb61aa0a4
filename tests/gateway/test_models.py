"""Several models behind one real gateway (issue 44): each request is validated with its own
model's tokenizer and caps and queued on its model's streams, read only by that model's
(fake) workers; aliases and LoRA adapters that workers announce resolve to their base model;
configured models without a worker are listed as ``scale_from_zero``; a worker reporting
another tokenizer than the gateway holds is refused loudly (ERROR log, /fleet, never routed
to, its model 503 ``tokenizer_mismatch`` while it lasts)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
import redis
import redis.asyncio

from common.redis_keys import heartbeat_key, kv_load_key, router_workers
from common.tokenizer_fingerprint import tokenizer_fingerprint
from gateway import keys
from gateway.model_config import ModelSpec
from gateway.model_registry import ModelRegistry, ServedModel
from gateway.routing.router import KvRouter
from gateway.routing.scoring import RouterConfig
from tests.gateway.fake_tokenizer import CharTokenizer
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.harness import start_gateway

ALPHA, BETA = CharTokenizer(300, context_length=128), CharTokenizer(200, context_length=64)


@pytest.fixture(scope="module")
def fleet(redis_server):
    """(gateway, redis client, {model: fake worker}) on a database of their own: models alpha
    (context 128) and beta (context 64) with a worker each, gamma configured without one."""
    url = redis_server.url.rsplit("/", 1)[0] + "/7"
    client = redis.Redis.from_url(url)
    client.flushdb()
    gw = start_gateway(url, models=("alpha=unused", "beta=unused", "gamma=unused"),
                       tokenizers={"alpha": ALPHA, "beta": BETA, "gamma": CharTokenizer(100)})
    workers = {m: FakeWorker(url, worker_id=f"fake-{m}", model=m).start() for m in ("alpha", "beta")}
    deadline = time.monotonic() + 5
    while len(client.keys("inflight:workers:*")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    yield gw, client, workers
    for w in workers.values():
        w.stop()
    gw.stop()
    client.flushdb()
    client.close()


def _post(gw, key: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(gw.rest_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)


def test_each_model_has_its_own_caps_stream_and_workers(fleet):
    gw, client, workers = fleet
    _, key = keys.create_key(client, "t", "models")
    r = _post(gw, key, {"model": "beta", "prompt": "héllo", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "beta"
    r = _post(gw, key, {"model": "alpha", "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["model"] == "alpha"
    assert [q.model for q in workers["beta"].requests] == ["beta"]
    assert [q.model for q in workers["alpha"].requests] == ["alpha"]
    assert workers["beta"].requests[0].prompt_token_ids == BETA.encode("héllo") != ALPHA.encode("héllo")
    # caps per model: 100 prompt tokens fit alpha's context (128), not beta's (64)
    assert _post(gw, key, {"model": "alpha", "prompt": "x" * 100, "max_tokens": 1}).status_code == 200
    r = _post(gw, key, {"model": "beta", "prompt": "x" * 100, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "at most 63" in r.json()["error"]["message"]


def test_models_list_aliases_adapters_and_scale_from_zero(fleet):
    gw, client, workers = fleet
    _, key = keys.create_key(client, "t", "models")
    beat = {"model": "beta", "served_model_names": ["beta", "beta-latest"], "max_model_len": 48,
            "tokenizer_fingerprint": tokenizer_fingerprint(BETA), "adapters": ["sql-lora"], "started": 1700000000}
    client.set(heartbeat_key("beta-2"), json.dumps(beat), ex=30)
    try:
        time.sleep(1.1)  # the registry re-reads the heartbeats at most once a second
        cards = {c["id"]: c for c in httpx.get(gw.rest_url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                                               timeout=10).json()["data"]}
        assert set(cards) == {"alpha", "beta", "beta-latest", "sql-lora", "gamma"}
        for path in ("/v1/models", "/v1/models/alpha"):  # Anthropic's header, as its client's models.list() sends
            assert httpx.get(gw.rest_url + path, headers={"x-api-key": key}, timeout=10).status_code == 200
        assert cards["gamma"]["scale_from_zero"] and not cards["alpha"]["scale_from_zero"]
        assert cards["beta"]["max_model_len"] == 48  # the smallest its workers announce
        assert cards["sql-lora"]["parent"] == "beta" and cards["beta-latest"]["root"] == "beta"
        assert cards["alpha"]["parent"] is None and cards["alpha"]["owned_by"] == "inflight"
        for name, lora in (("sql-lora", "sql-lora"), ("beta-latest", "")):
            r = _post(gw, key, {"model": name, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name
            queued = workers["beta"].requests[-1]
            assert (queued.model, queued.lora_name) == ("beta", lora)  # the base model's stream
        r = _post(gw, key, {"model": "beta", "prompt": "x" * 50, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        client.delete(heartbeat_key("beta-2"))


def test_a_worker_with_another_tokenizer_is_refused_loudly(fleet, caplog):
    gw, client, workers = fleet
    _, key = keys.create_key(client, "t", "models")
    _, admin = keys.create_key(client, "t", "admin", admin=True)
    rogue = {"model": "alpha", "tokenizer_fingerprint": "0123456789abcdef", "started": time.time()}
    client.set(heartbeat_key("rogue"), json.dumps(rogue), ex=30)
    try:
        time.sleep(1.1)
        with caplog.at_level(logging.ERROR, logger="gateway.model_registry"):
            r = _post(gw, key, {"model": "alpha", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "tokenizer_mismatch"
        assert "rogue" not in r.json()["error"]["message"]  # worker ids are for the operator, not clients
        assert any("worker rogue refused" in rec.getMessage() for rec in caplog.records)
        assert _post(gw, key, {"model": "beta", "prompt": "hi", "max_tokens": 2}).status_code == 200  # others serve
        fleet_view = httpx.get(gw.rest_url + "/fleet", headers={"Authorization": f"Bearer {admin}"}, timeout=10).json()
        refused = {w["worker_id"]: w["refused"] for w in fleet_view["workers"]}
        assert "fingerprint 0123456789abcdef" in refused["rogue"] and refused["fake-alpha"] == ""
    finally:
        client.delete(heartbeat_key("rogue"))
    time.sleep(1.1)
    assert _post(gw, key, {"model": "alpha", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_the_router_never_picks_a_refused_worker(redis_url):
    """A worker of model m with a load hash and a registration, but another tokenizer: the
    router's candidates for m leave it out; the matching worker stays."""
    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_url)
        tokenizer = CharTokenizer()
        registry = ModelRegistry(client, [ServedModel(ModelSpec("m"), tokenizer, tokenizer_fingerprint(tokenizer), 0)])
        for worker, fingerprint in (("good", tokenizer_fingerprint(tokenizer)), ("bad", "ffffffffffffffff")):
            await client.set(heartbeat_key(worker), json.dumps({"model": "m", "tokenizer_fingerprint": fingerprint}))
            await client.hset(kv_load_key(worker), mapping={"block_size": 4, "salt": "", "total_blocks": 8})
            await client.sadd(router_workers("m"), worker)
        router = KvRouter(client, RouterConfig(), refused=registry.refused_workers)
        try:
            return await router.workers("m"), await registry.refused_workers()
        finally:
            for worker in ("good", "bad"):
                await client.delete(heartbeat_key(worker), kv_load_key(worker))
            await client.delete(router_workers("m"))
            await client.aclose()

    candidates, refused = asyncio.run(scenario())
    # other tests' workers may still hold heartbeats in the shared Redis: only these two matter
    assert candidates == ["good"] and "bad" in refused and "good" not in refused


def test_a_name_resolves_to_one_thing_the_later_claim_logged(redis_url, caplog):
    """Found by the new-user trial: a worker's alias equal to another worker's adapter (or to
    another model's id) was served as whichever heartbeat came first in key order. The earlier
    started worker's claim wins; the later one is ignored and logged at ERROR."""
    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_url)
        tok = CharTokenizer()
        served = [ServedModel(ModelSpec(m), tok, tokenizer_fingerprint(tok), 0) for m in ("a", "b")]
        registry = ModelRegistry(client, served)
        beats = {  # the later-started worker has the earlier id: key order must not decide
            "w2": {"served_model_names": ["a", "a-latest", "b"], "adapters": ["sql"], "started": 100},
            "w1": {"served_model_names": ["b", "sql"], "adapters": ["a-latest"], "started": 200}}
        for worker, beat in beats.items():
            await client.set(heartbeat_key(worker), json.dumps({**beat, "tokenizer_fingerprint": tokenizer_fingerprint(tok)}))
        try:
            resolved = {n: (r.model_id, r.lora_name) for n in ("sql", "a-latest", "b")
                        for r in [await registry.resolve_model(n)]}
            listing = {(e.id, e.parent) for e in await registry.listing()}
            return resolved, listing
        finally:
            await client.delete(*(heartbeat_key(w) for w in beats))
            await client.aclose()

    with caplog.at_level(logging.ERROR, logger="gateway.model_registry"):
        resolved, listing = asyncio.run(scenario())
    assert resolved == {"sql": ("a", "sql"), "a-latest": ("a", ""), "b": ("b", "")}
    assert listing == {("a", ""), ("a-latest", ""), ("sql", "a"), ("b", "")}
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "worker w1 announces 'sql' as an alias of model b, but 'sql' is already an adapter of model a" in logged
    assert "worker w1 announces 'a-latest' as an adapter of model b" in logged
    assert "worker w2 announces 'b' as an alias of model a" in logged
