"""LoRA adapters through the whole stack with the real SmolLM2 model: a worker started with
``--enable-lora --lora-modules sql=...``, the gateway and nginx; the official ``openai`` client
lists the adapter and generates with it (alone, streamed, and in the same batch as the base
model), and an admin key loads and unloads another adapter at run time with vLLM's endpoints."""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from bench.lora import write_random_adapter
from common.model_files import default_model_path
from stack.edge import nginx_binary
from stack.stack import Stack, StackSettings
from tests.helpers.redis_server import free_port, start_redis
from worker.model.loader import check_model

openai = pytest.importorskip("openai")
BASE = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def lora_stack():
    """(stack, adapters folder): a stack whose worker serves adapter ``sql`` from the start."""
    if nginx_binary() is None:
        pytest.fail("nginx is required for the end-to-end tests (.ci/run installs it)")
    folder = Path(tempfile.mkdtemp(prefix="inflight-lora-"))
    config = check_model(default_model_path())
    write_random_adapter(folder / "sql", config, rank=8, seed=1)
    write_random_adapter(folder / "chat", config, rank=16, seed=2)
    write_random_adapter(folder / "big", config, rank=32, seed=3)
    redis = start_redis()
    settings = StackSettings(
        run_dir=folder / "run", redis_url=redis.url, rest_port=free_port(), grpc_port=free_port(),
        link_port=free_port(), worker_health_port=free_port(), worker_grpc_health_port=free_port(),
        edge_rest_port=free_port(), edge_grpc_port=free_port(),
        edge_overrides={"ip_rate": 1000, "ip_burst": 1000, "key_rate": 1000, "key_burst": 1000},
        worker_args=("--device", "cpu", "--dtype", "float32", "--kv-cache-mib", "128", "--enable-lora",
                     "--max-loras", "2", "--lora-modules", f"sql={folder / 'sql'}"))
    stack = Stack(settings)
    try:
        stack.start()
    except BaseException:
        stack.stop()
        redis.stop()
        raise
    yield stack, folder
    stack.stop()
    redis.stop()


def _ids(client) -> list[str]:
    return [m.id for m in client.models.list().data]


def _chat(client, model: str) -> str:
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    assert out.model == model
    return out.choices[0].message.content


def _wait(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_openai_client_lists_and_runs_an_adapter_beside_the_base_model(lora_stack):
    stack, _ = lora_stack
    client = openai.OpenAI(base_url=f"{stack.endpoints()['rest']}/v1", api_key=stack.create_key(tenant="t"),
                           max_retries=0, timeout=180)
    assert _wait(lambda: "sql" in _ids(client)), _ids(client)
    assert BASE in _ids(client)
    base, adapted = _chat(client, BASE), _chat(client, "sql")
    assert adapted != base  # a random adapter changes the greedy text
    stream = client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=16, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == adapted
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # base and adapter rows in the same steps
        texts = list(pool.map(lambda m: _chat(client, m), [BASE, "sql", BASE, "sql"]))
    assert texts == [base, adapted, base, adapted]


def test_admin_loads_and_unloads_an_adapter_at_run_time(lora_stack):
    stack, folder = lora_stack
    rest = stack.endpoints()["rest"]
    admin, user = stack.create_key(tenant="ops", admin=True), stack.create_key(tenant="t")
    client = openai.OpenAI(base_url=f"{rest}/v1", api_key=user, max_retries=0, timeout=180)

    def post(path: str, key: str, body: dict) -> httpx.Response:
        return httpx.post(f"{rest}{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)

    body = {"lora_name": "chat", "lora_path": str(folder / "chat")}
    assert post("/v1/load_lora_adapter", user, body).status_code == 403
    refused = post("/v1/load_lora_adapter", admin, {"lora_name": "big", "lora_path": str(folder / "big")})
    assert refused.status_code == 400 and "rank 32 exceeds --max-lora-rank 16" in refused.text
    loaded = post("/v1/load_lora_adapter", admin, body)
    assert loaded.status_code == 200, loaded.text
    assert _wait(lambda: "chat" in _ids(client)), _ids(client)
    assert _chat(client, "chat") not in (_chat(client, BASE), _chat(client, "sql"))
    assert post("/v1/unload_lora_adapter", admin, {"lora_name": "chat"}).status_code == 200
    assert _wait(lambda: "chat" not in _ids(client)), _ids(client)
    with pytest.raises(openai.NotFoundError):
        _chat(client, "chat")
