"""worker/serve/lora_sync.py against a real Redis: an operation whose engine call fails in an
unexpected way (not a ValueError/OSError refusal) is reported once as a 500 naming the error and
never retried every tick (the new-user trial's huge ``lora_alpha`` looped forever)."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from common.lora_control import LoraOp, desired_key, result_key
from worker.serve.lora_sync import LoraSync, stop_sync


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


class HeldEngine:
    """An engine whose adapter loads succeed, run through ``run_on_engine``, which holds each call
    until ``release`` is set (``started`` tells the test a tick is in flight)."""

    def __init__(self) -> None:
        self.started, self.release = asyncio.Event(), asyncio.Event()

    def add_lora(self, name: str, path: str) -> None:
        return None

    async def run_on_engine(self, fn, *args):
        self.started.set()
        await self.release.wait()
        return fn(*args)


async def start_held_tick(client, model: str, adapter: str) -> tuple[LoraSync, asyncio.Task, LoraOp, HeldEngine]:
    """A sync (30 s period) for ``model`` running with one load of ``adapter`` desired, returned
    once that load's engine call is in flight and held."""
    engine = HeldEngine()
    sync = LoraSync(client, engine, engine.run_on_engine, model, "w1", period_s=30)
    op = LoraOp.load(adapter, f"/adapters/{adapter}")
    await client.hset(desired_key(model), op.name, op.to_json())
    task = asyncio.create_task(sync.run())
    await asyncio.wait_for(engine.started.wait(), 5)
    return sync, task, op, engine


def test_stop_ends_the_run_between_ticks_without_cancelling_one(redis_url):
    """stop() returns run() within a period, after the tick in progress finished (an engine call
    that is mid-flight when stop() comes is completed and reported, not cut off)."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        sync, task, op, engine = await start_held_tick(client, "m2", "b")
        sync.stop()
        engine.release.set()
        await asyncio.wait_for(task, 5)  # a 30 s period: returns only because stop() was seen
        assert json.loads(await client.hget(result_key(op.op), "w1")) == {"ok": True}
        await client.aclose()

    asyncio.run(scenario())


def test_the_workers_shutdown_lets_a_tick_finish_and_cancels_only_past_its_grace(redis_url):
    """stop_sync (the worker's shutdown) stops the sync between ticks: a tick in flight completes
    and reports; a tick that outlives the grace is cancelled, so shutdown cannot hang on it."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        for released, model in ((True, "m3"), (False, "m4")):
            sync, task, op, engine = await start_held_tick(client, model, "c")
            if released:
                asyncio.get_running_loop().call_later(0.2, engine.release.set)
            await asyncio.wait_for(stop_sync(sync, task, grace_s=2.0), 5)
            assert task.done()
            assert task.cancelled() is not released
            reported = await client.hget(result_key(op.op), "w1")
            assert (json.loads(reported) == {"ok": True}) if released else reported is None
        await client.aclose()

    asyncio.run(scenario())
