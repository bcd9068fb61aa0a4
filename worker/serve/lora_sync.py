"""The worker's side of the LoRA control channel (common/lora_control.py): every heartbeat
period, apply the model's adapter operations this worker has not applied yet (load or unload,
on the engine thread, between steps) and report each outcome for the gateway's admin endpoint.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from common.lora_control import RESULT_TTL_S, LoraOp, desired_key, outcome, result_key

log = logging.getLogger(__name__)


class LoraSync:
    """Reconciles one worker's adapters with ``inflight:lora:{model}``.

    Args:
        redis: the worker's asyncio Redis client.
        engine: has ``add_lora(name, path)`` (raises ValueError / OSError naming why it refuses)
            and ``remove_lora(name) -> bool``.
        run: runs a function on the engine thread (``EngineThread.run``), so a load never
            overlaps a step.
        model: the model id whose operations this worker applies.
        worker_id: its id, the key of its reports.
        period_s: seconds between ticks (the heartbeat's).
    """

    def __init__(self, redis: Any, engine: Any, run: Any, model: str, worker_id: str, period_s: float) -> None:
        self.redis, self.engine, self.run_on_engine = redis, engine, run
        self.model, self.worker_id, self.period_s = model, worker_id, period_s
        self._applied: dict[str, str] = {}  # adapter name -> the last operation id applied
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the tick in progress, if any (call on the sync's loop).

        Stopping between ticks, not cancelling inside one, leaves the Redis connection idle: a
        task cancelled in the middle of a read can leave redis-py's close waiting on it.
        """
        self._stopping.set()

    async def run(self) -> None:
        """Tick until :meth:`stop` (or cancelled); a Redis error is logged and the next tick tries again."""
        while not self._stopping.is_set():
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - Redis may be restarting; keep trying
                log.warning("LoRA adapter sync failed: %s", exc)
            try:
                await asyncio.wait_for(self._stopping.wait(), self.period_s)
            except asyncio.TimeoutError:
                pass

    async def tick(self) -> int:
        """Apply the operations not applied yet; returns how many ran."""
        ran = 0
        for field, raw in (await self.redis.hgetall(desired_key(self.model))).items():
            op = LoraOp.from_json(field, raw)
            if op is None or self._applied.get(op.name) == op.op:
                continue
            report = await self._apply(op)
            self._applied[op.name] = op.op
            await self.redis.hset(result_key(op.op), self.worker_id, report)
            await self.redis.expire(result_key(op.op), RESULT_TTL_S)
            ran += 1
        return ran

    async def _apply(self, op: LoraOp) -> str:
        """Run ``op`` on the engine; the report."""
        try:
            if op.unload:
                if not await self.run_on_engine(self.engine.remove_lora, op.name):
                    return outcome(f"The lora adapter '{op.name}' cannot be found.", status=404)
                log.info("LoRA adapter %s unloaded", op.name)
            else:
                await self.run_on_engine(self.engine.add_lora, op.name, op.path)
                log.info("LoRA adapter %s loaded from %s", op.name, op.path)
        except (ValueError, OSError) as exc:
            log.warning("LoRA adapter %s: %s", op.name, exc)
            return outcome(str(exc))
        except Exception as exc:  # noqa: BLE001 - any failure is this operation's report, never a retry loop
            log.exception("LoRA adapter %s: the %s failed", op.name, "unload" if op.unload else "load")
            return outcome(f"LoRA adapter {op.name!r}: {type(exc).__name__}: {exc}", status=500)
        return outcome()


async def stop_sync(sync: LoraSync, task: asyncio.Task, grace_s: float = 5.0) -> None:
    """End ``task`` (running ``sync.run()``) between its ticks (:meth:`LoraSync.stop`), cancelling
    it only after ``grace_s`` seconds: a task cancelled inside a Redis read can leave the
    connection's close, which a shutdown does next, waiting on it."""
    sync.stop()
    try:
        await asyncio.wait_for(task, grace_s)  # cancels the task when the grace runs out
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
    except Exception as exc:  # noqa: BLE001 - the sync logs its own errors; shutdown goes on
        log.warning("LoRA adapter sync ended with %s", exc)
