"""worker/serve/lora_sync.py against a real Redis: an operation whose engine call fails in an
unexpected way (not a ValueError/OSError refusal) is reported once as a 500 naming the error and
never retried every tick (the new-user trial's huge ``lora_alpha`` looped forever)."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from common.lora_control import LoraOp, desired_key, result_key
from worker.serve.lora_sync import LoraSync


class FailingEngine:
    """An engine whose every load raises RuntimeError."""

    def __init__(self) -> None:
        self.loads = 0

    def add_lora(self, name: str, path: str) -> None:
        self.loads += 1
        raise RuntimeError("boom")


def test_an_unexpected_failure_is_reported_once(redis_url):
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        engine = FailingEngine()

        async def run_on_engine(fn, *args):
            return fn(*args)

        sync = LoraSync(client, engine, run_on_engine, "m", "w1", period_s=0.01)
        op = LoraOp.load("a", "/adapters/a")
        await client.hset(desired_key("m"), op.name, op.to_json())
        assert await sync.tick() == 1
        report = json.loads(await client.hget(result_key(op.op), "w1"))
        assert report["status"] == 500 and "RuntimeError: boom" in report["error"]
        assert await sync.tick() == 0 and engine.loads == 1
        await client.aclose()

    asyncio.run(scenario())
