"""A key's model list and its limits per model through the real gateway (issue 44 item 4):
a key limited to some models sees only those in /v1/models (REST and gRPC) and gets OpenAI's
404 model_not_found for the others, with nothing reserved; a key's requests/min for one
model refuses that model with a 429 naming it while the key's other models go on."""

from __future__ import annotations

import grpc
import httpx

from gateway import keys
from protos import inference_pb2, inference_pb2_grpc
from tests.gateway.test_models import _post, fleet  # noqa: F401 - the module's fixture, reused


def _models(gw, key: str) -> list[str]:
    r = httpx.get(gw.rest_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 200
    return sorted(m["id"] for m in r.json()["data"])


def _grpc_models(gw, key: str) -> list[str]:
    with grpc.insecure_channel(gw.grpc_target) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(), metadata=[("authorization", f"Bearer {key}")], timeout=10)
    return sorted(m.id for m in reply.models)


def test_a_key_limited_to_some_models_sees_and_uses_only_those(fleet):  # noqa: F811
    gw, client, workers = fleet
    key_id, key = keys.create_key(client, "t", "alpha only", models=("alpha",), requests_per_min=100)
    assert _models(gw, key) == ["alpha"]
    assert _grpc_models(gw, key) == ["alpha"]
    queued = len(workers["beta"].requests)
    r = _post(gw, key, {"model": "beta", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert len(workers["beta"].requests) == queued  # nothing queued ...
    assert client.zcard(f"inflight:rl:{{{key_id}}}:req") == 0  # ... nor counted in the key's window
    r = httpx.get(gw.rest_url + "/v1/models/beta", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert r.status_code == 404
    assert _post(gw, key, {"model": "alpha", "prompt": "hi", "max_tokens": 2}).status_code == 200
    _, other = keys.create_key(client, "t", "every model")
    assert {"alpha", "beta"} <= set(_models(gw, other))


def test_a_keys_requests_per_min_for_one_model_leaves_its_other_models_alone(fleet):  # noqa: F811
    gw, client, _ = fleet
    key_id, key = keys.create_key(client, "t", "beta capped")
    keys.set_limits(client, key_id, model="beta", requests_per_min=2)
    for _ in range(2):
        assert _post(gw, key, {"model": "beta", "prompt": "hi", "max_tokens": 2}).status_code == 200
    r = _post(gw, key, {"model": "beta", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "key_rate"
    assert "model 'beta'" in r.json()["error"]["message"]
    assert r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "0"
    for _ in range(3):
        assert _post(gw, key, {"model": "alpha", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_limits_set_for_an_alias_apply_to_that_name_and_the_ids_to_every_alias(fleet):  # noqa: F811
    import json
    import time

    from common.redis_keys import heartbeat_key
    from common.tokenizer_fingerprint import tokenizer_fingerprint
    from tests.gateway.test_models import BETA

    gw, client, _ = fleet
    beat = {"model": "beta", "served_model_names": ["beta", "beta-next"], "max_model_len": 64,
            "tokenizer_fingerprint": tokenizer_fingerprint(BETA), "adapters": [], "started": 1700000000}
    client.set(heartbeat_key("beta-alias"), json.dumps(beat), ex=30)
    try:
        time.sleep(1.1)  # the registry re-reads the heartbeats at most once a second
        alias_id, alias_key = keys.create_key(client, "t", "alias capped")
        keys.set_limits(client, alias_id, model="beta-next", requests_per_min=1)
        assert _post(gw, alias_key, {"model": "beta-next", "prompt": "hi", "max_tokens": 2}).status_code == 200
        r = _post(gw, alias_key, {"model": "beta-next", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and "model 'beta-next'" in r.json()["error"]["message"]
        assert _post(gw, alias_key, {"model": "beta", "prompt": "hi", "max_tokens": 2}).status_code == 200
        id_id, id_key = keys.create_key(client, "t", "id capped")
        keys.set_limits(client, id_id, model="beta", requests_per_min=1)
        assert _post(gw, id_key, {"model": "beta-next", "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert _post(gw, id_key, {"model": "beta", "prompt": "hi", "max_tokens": 2}).status_code == 429
    finally:
        client.delete(heartbeat_key("beta-alias"))


def test_a_model_outside_the_keys_list_is_404_before_its_task_is_told(fleet):  # noqa: F811
    """/v1/embeddings to a generating model the key may not use: 404 model_not_found, not the
    400 model_not_supported that tells the key the model exists (docs/ADMISSION.md)."""
    gw, client, _ = fleet
    _, key = keys.create_key(client, "t", "alpha only", models=("alpha",))
    r = httpx.post(gw.rest_url + "/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "beta", "input": "hi"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.post(gw.rest_url + "/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "alpha", "input": "hi"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
