"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter through the real gateway app and a
real Redis, applied by a worker's real LoraSync on a real engine (a tiny random Llama with
LoRA enabled): admin keys only, refusals as 400 naming why, unknown adapters 404, and a worker
that starts later loading what was loaded at run time."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import redis
import redis.asyncio as aioredis
import torch

from common.lora_control import desired_key
from gateway import keys
from tests.gateway.conftest import wait_for

pytest.importorskip("safetensors")

R = 4
SHAPES = {"q_proj": (64, 64), "v_proj": (32, 64), "down_proj": (64, 128)}  # (out, in) of the tiny runner


def _adapter(folder, rank: int = R, targets=("q_proj", "v_proj", "down_proj")) -> str:
    """A PEFT-format adapter for the tiny runner (2 layers, hidden 64, kv 32, inter 128)."""
    from safetensors.torch import save_file

    folder.mkdir()
    tensors = {}
    gen = torch.Generator().manual_seed(rank)
    for layer in range(2):
        for module in targets:
            out, inp = SHAPES.get(module, (64, 64))
            kind = "mlp" if module.endswith(("down_proj", "up_proj", "gate_proj")) else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
         "base_model_name_or_path": "tiny-random-llama"}))
    return str(folder)


class Worker:
    """A worker's LoRA side: a real engine and :class:`worker.serve.lora_sync.LoraSync` on its own
    asyncio loop, listening to the gateway's default model."""

    def __init__(self, redis_url: str, model: str, worker_id: str) -> None:
        from tests.worker.fakes import fake_tokenizer
        from worker.engine.engine import LLMEngine
        from worker.engine.engine_config import EngineConfig
        from worker.model.model_runner import tiny_random_runner
        from worker.serve.lora_sync import LoraSync

        tokenizer = fake_tokenizer()
        runner = tiny_random_runner(vocab_size=tokenizer.vocab_size, num_blocks=16)
        self.engine = LLMEngine(runner, tokenizer, EngineConfig(block_size=16, enable_lora=True, max_loras=2))
        self.loop = asyncio.new_event_loop()
        self.client = aioredis.Redis.from_url(redis_url)

        async def run_on_engine(fn, *args):
            return fn(*args)

        self.sync = LoraSync(self.client, self.engine, run_on_engine, model, worker_id, period_s=0.05)
        # Created before the thread starts: a stop() right after the start is queued on the loop
        # and seen when it runs (a stop that found nothing to stop left the sync ticking past the
        # test's Redis).
        self.stopping = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._lifetime(),), daemon=True)
        self.thread.start()

    async def _lifetime(self) -> None:
        """Sync until stop(), then shut down as the worker does: the sync between its ticks
        (stop_sync), then the Redis client, bounded (a close waiting on a connection cancelled
        half-way outlived stop()'s join once, and the still-running worker, of the same id,
        answered the next test's request)."""
        from worker.serve.lora_sync import stop_sync

        task = asyncio.create_task(self.sync.run())
        await self.stopping.wait()
        await stop_sync(self.sync, task, grace_s=10)
        try:
            await asyncio.wait_for(self.client.aclose(), 5)
        except asyncio.TimeoutError:
            pass

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the worker's LoRA sync did not stop"
        self.loop.close()


@pytest.fixture()
def setup(redis_url, gateway):
    """(gateway, admin key, plain key, a worker); the worker stopped after the test."""
    client = redis.Redis.from_url(redis_url)
    _, admin = keys.create_key(client, "ops", "admin", admin=True)
    _, plain = keys.create_key(client, "tenant-a", "user")
    client.close()
    worker = Worker(redis_url, gateway.settings.served_model_name, "w1")
    yield gateway, admin, plain, worker
    worker.stop()


def _post(gateway, path: str, key: str | None, body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gateway.rest_url + path, headers=headers, timeout=60,
                      **({"content": body} if isinstance(body, str) else {"json": body}))


def test_only_admin_keys_may_load_or_unload(setup, tmp_path):
    gateway, _, plain, worker = setup
    path = _adapter(tmp_path / "a")
    for route, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path}),
                        ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        denied = _post(gateway, route, plain, body)
        assert denied.status_code == 403, denied.text
        assert denied.json()["error"]["code"] == "admin_key_required"
        assert _post(gateway, route, None, body).status_code == 401
    assert worker.engine.lora_names() == []


def test_load_then_unload_through_the_gateway(setup, tmp_path, redis_url):
    gateway, admin, _, worker = setup
    path = _adapter(tmp_path / "sql")
    loaded = _post(gateway, "/v1/load_lora_adapter", admin, {"lora_name": "sql", "lora_path": path})
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'sql' added successfully."
    assert worker.engine.lora_names() == ["sql"]
    late = Worker(redis_url, gateway.settings.served_model_name, "w2")  # a worker started afterwards
    try:
        assert wait_for(lambda: late.engine.lora_names() == ["sql"], timeout_s=30)
    finally:
        late.stop()
    unloaded = _post(gateway, "/v1/unload_lora_adapter", admin, {"lora_name": "sql"})
    assert unloaded.status_code == 200, unloaded.text
    assert worker.engine.lora_names() == []
    again = _post(gateway, "/v1/unload_lora_adapter", admin, {"lora_name": "sql"})
    assert again.status_code == 404 and "cannot be found" in again.json()["error"]["message"]


def test_bad_adapters_are_400_naming_why_and_not_kept(setup, tmp_path, redis_url):
    gateway, admin, _, worker = setup
    cases = {
        "big": (_adapter(tmp_path / "big", rank=32), "rank 32 exceeds --max-lora-rank 16"),
        "gpt2": (_adapter(tmp_path / "gpt2", targets=("c_attn",)), "['c_attn']"),
        "missing": (str(tmp_path / "nowhere"), "has no adapter_config.json"),
    }
    for name, (path, why) in cases.items():
        refused = _post(gateway, "/v1/load_lora_adapter", admin, {"lora_name": name, "lora_path": path})
        assert refused.status_code == 400, (name, refused.text)
        assert why in refused.json()["error"]["message"], (name, refused.text)
    assert worker.engine.lora_names() == []
    client = redis.Redis.from_url(redis_url)
    assert client.hgetall(desired_key(gateway.settings.served_model_name)) == {}  # later workers do not retry them
    client.close()
    for body in ('{"lora_name": "x"}', "not json", '{"lora_name": "", "lora_path": "/p"}'):
        assert _post(gateway, "/v1/load_lora_adapter", admin, body).status_code == 400, body
    unknown_model = _post(gateway, "/v1/load_lora_adapter", admin,
                          {"lora_name": "x", "lora_path": "/p", "model": "no-such-model"})
    assert unknown_model.status_code == 404


def test_an_adapter_of_another_base_model_is_400_naming_both(setup, tmp_path):
    """Shapes that fit, a base_model_name_or_path naming another model than the worker's:
    refused by name (worker/model/lora_base.py); an adapter of this model still loads."""
    from worker.model.lora_base import ModelIdentity

    gateway, admin, _, worker = setup
    worker.engine.runner.model_identity = ModelIdentity(names=("tiny-random-llama",))
    other = _adapter(tmp_path / "other")
    config_path = tmp_path / "other" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()),
                                       "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}))
    refused = _post(gateway, "/v1/load_lora_adapter", admin, {"lora_name": "other", "lora_path": other})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_lora_adapter"
    assert "trained on 'meta-llama/Llama-3.2-1B', this worker's model is 'tiny-random-llama'" in error["message"]
    assert "base model mismatch" in error["message"]
    mine = _post(gateway, "/v1/load_lora_adapter", admin, {"lora_name": "mine", "lora_path": _adapter(tmp_path / "mine")})
    assert mine.status_code == 200, mine.text
    assert worker.engine.lora_names() == ["mine"]


def test_an_adapter_may_not_take_a_models_name_nor_an_unsafe_one(setup, tmp_path):
    """Found by the new-user trial: an adapter loaded as a model's id or alias took over the
    requests for that model; a name with a newline reached log lines and error bodies."""
    gateway, admin, _, worker = setup
    path = _adapter(tmp_path / "a")
    for name, code in ((gateway.settings.served_model_name, "lora_name_taken"), ("a\nb", None), ("x" * 129, None)):
        refused = _post(gateway, "/v1/load_lora_adapter", admin, {"lora_name": name, "lora_path": path})
        assert refused.status_code == 400, (name, refused.text)
        assert refused.json()["error"]["param"] == "lora_name"
        assert code is None or refused.json()["error"]["code"] == code
    assert worker.engine.lora_names() == []
    unknown_model = _post(gateway, "/v1/load_lora_adapter", admin, {"lora_name": "a", "lora_path": path, "model": "nope"})
    assert unknown_model.json()["error"]["type"] == "invalid_request_error"  # as every other front's 404
    assert unknown_model.json()["error"]["code"] == "model_not_found"
    form = httpx.post(gateway.rest_url + "/v1/load_lora_adapter", headers={"authorization": f"Bearer {admin}"},
                      content='{"lora_name": "a", "lora_path": "/p"}', timeout=60)  # no JSON Content-Type
    assert form.status_code == 400 and form.json()["error"]["code"] == "invalid_content_type"


def test_an_adapter_may_not_take_another_base_models_adapter_name(redis_url):
    """Found by the new-user trial: the load checked models' names only, so one name could be an
    adapter of two base models (announced now, or desired while no worker of it runs)."""
    from types import SimpleNamespace

    from common.lora_control import LoraOp
    from common.redis_keys import heartbeat_key
    from common.tokenizer_fingerprint import tokenizer_fingerprint
    from gateway.errors import InvalidRequestError
    from gateway.model_config import ModelSpec
    from gateway.model_registry import ModelRegistry, ServedModel
    from gateway.rest.lora_admin import _check_load
    from tests.gateway.fake_tokenizer import CharTokenizer

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        tok = CharTokenizer()
        registry = ModelRegistry(client, [ServedModel(ModelSpec(m), tok, tokenizer_fingerprint(tok), 0)
                                          for m in ("a", "b")])
        service = SimpleNamespace(models=registry, redis=client, settings=SimpleNamespace(served_model_name="a"))
        await client.set(heartbeat_key("wa"), json.dumps({"served_model_names": ["a"], "adapters": ["sql"],
                                                          "tokenizer_fingerprint": tokenizer_fingerprint(tok)}))
        await client.hset(desired_key("a"), "later", LoraOp.load("later", "/p").to_json())
        await client.hset(desired_key("a"), "gone", LoraOp.remove("gone").to_json())
        refusals = {}
        try:
            for name, model in (("sql", "b"), ("later", "b"), ("sql", "a"), ("later", "a"), ("gone", "b")):
                try:
                    await _check_load(service, name, model)
                    refusals[(name, model)] = None
                except InvalidRequestError as err:
                    refusals[(name, model)] = (err.param, err.code, err.message)
        finally:
            await client.delete(heartbeat_key("wa"), desired_key("a"))
            await client.aclose()
        return refusals

    refusals = asyncio.run(scenario())
    for name in ("sql", "later"):
        param, code, message = refusals[(name, "b")]
        assert (param, code) == ("lora_name", "lora_name_taken") and "already an adapter of model 'a'" in message
    assert refusals[("sql", "a")] is refusals[("later", "a")] is refusals[("gone", "b")] is None  # reloads, unloaded
