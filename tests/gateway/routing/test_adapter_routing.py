"""The KV-aware router and LoRA adapters (issue 44): a worker announces each adapter's identity
in its load hash (``lora_salts``), and an adapter request's prompt is hashed with that identity,
so it goes to the worker holding that adapter's blocks, never to one holding only the base
model's blocks of the same prompt (their KV differs), and a base request the other way round.
Real Redis; the load hashes and block sets as workers publish them."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio

from common.block_hash import adapter_salt, hash_bytes, prompt_block_hashes
from common.redis_keys import kv_blocks_key, kv_load_key, router_workers
from gateway.routing.router import KvRouter
from gateway.routing.scoring import RouterConfig
from protos import queue_pb2

MODEL, SALT, BLOCK = "m", "model-salt", 4
PROMPT = list(range(1, 34))  # 8 full blocks of 4 and one token


async def _publish(client, worker: str, salt: str, lora_salts: dict[str, str]) -> None:
    await client.sadd(router_workers(MODEL), worker)
    await client.hset(kv_load_key(worker), mapping={
        "running": 0, "waiting": 0, "free_blocks": 100, "total_blocks": 100, "block_size": BLOCK,
        "salt": SALT, "lora_salts": json.dumps(lora_salts), "prefix_caching": 1})
    held = [hash_bytes(h) for h in prompt_block_hashes(PROMPT, BLOCK, salt)]
    await client.sadd(kv_blocks_key(worker), *held)


def test_an_adapter_request_goes_to_the_worker_holding_that_adapters_blocks(redis_url):
    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        sql = "sql@0f1e"  # the identity LLMEngine.lora_salts() announces: name@digest of its files
        await _publish(client, "w-adapter", adapter_salt(SALT, sql), {"sql": sql})
        await _publish(client, "w-base", SALT, {})
        router = KvRouter(client, RouterConfig())
        adapter = await router.route(queue_pb2.QueuedRequest(prompt_token_ids=PROMPT, model=MODEL, lora_name="sql",
                                                             priority=1))
        base = await router.route(queue_pb2.QueuedRequest(prompt_token_ids=PROMPT, model=MODEL, priority=1))
        other = await router.route(queue_pb2.QueuedRequest(prompt_token_ids=PROMPT, model=MODEL, lora_name="chat",
                                                           priority=1))
        await client.aclose()
        return adapter, base, other

    adapter, base, other = asyncio.run(go())
    assert (adapter.worker_id, adapter.overlap_blocks) == ("w-adapter", 8)
    assert (base.worker_id, base.overlap_blocks) == ("w-base", 8)
    assert other.overlap_blocks == 0  # an adapter nobody announces matches no block
