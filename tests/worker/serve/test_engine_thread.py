"""worker.serve.engine_thread: the model load, the warm-up and every step run on one thread.

Why it matters (one OpenMP team, not two) is measured in bench/RESULTS.md run 12;
these tests pin the wiring that gives it.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import worker.serve.main
from worker.serve.engine_thread import THREAD_NAME, EngineThread
from worker.serve.settings import WorkerSettings


def _name() -> str:
    return threading.current_thread().name


def test_calls_run_in_order_on_one_named_thread_and_raise_here():
    async def go():
        thread = EngineThread()
        names = [await thread.run(_name) for _ in range(3)]
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        after = await thread.run(_name)  # the thread survives an exception
        thread.shutdown()
        return names + [after]

    names = asyncio.run(go())
    assert len(set(names)) == 1 and names[0].startswith(THREAD_NAME) and names[0] != _name()


class _Redis:
    async def set(self, *a, **k): pass
    async def delete(self, *a): pass
    async def aclose(self): pass


def test_worker_loads_warms_up_and_steps_on_the_same_thread(monkeypatch):
    seen: dict[str, str] = {}
    runner = SimpleNamespace(warmup=lambda n: seen.setdefault("warmup", _name()), num_blocks=8)
    engine = SimpleNamespace(runner=runner, step=lambda: seen.setdefault("step", _name()))

    def build_engine(settings):
        seen["load"] = _name()
        return engine, "fake-model"

    class Service:
        def __init__(self, settings, engine, redis, model_name, metrics, engine_thread, tracer=None,
                     before_step=None):
            self.engine, self.engine_thread, self.before_step = engine, engine_thread, before_step

        async def run(self):
            await self.engine_thread.run(self.before_step)
            await self.engine_thread.run(self.engine.step)

        def stop(self, grace_s=None): pass

    class Governor:  # the thread governor's tick runs where the OpenMP team lives
        def __init__(self, threads, set_threads):
            pass

        def tick(self):
            seen.setdefault("governor", _name())

    monkeypatch.setattr(worker.serve.main, "build_engine", build_engine)
    monkeypatch.setattr(worker.serve.main, "WorkerService", Service)
    monkeypatch.setattr(worker.serve.main, "ThreadGovernor", Governor)
    monkeypatch.setattr(worker.serve.main, "redis_client", lambda url, password=None: _Redis())
    asyncio.run(worker.serve.main.serve(WorkerSettings(health_port=0, grpc_health_port=0, warmup_tokens=4)))
    assert set(seen) == {"load", "warmup", "step", "governor"}
    assert len(set(seen.values())) == 1 and seen["load"].startswith(THREAD_NAME)


def test_the_real_service_steps_on_the_engine_thread_it_is_given():
    from tests.worker.engine_helpers import make_engine
    from worker.serve.service import WorkerService

    engine = make_engine(num_blocks=8, block_size=4)
    step, names = engine.step, []
    engine.step = lambda: (names.append(threading.get_ident()), step())[1]
    thread = EngineThread()
    service = WorkerService(WorkerSettings(health_port=0), engine, None, "fake", engine_thread=thread)

    async def go():
        await service._step()
        return await thread.run(threading.get_ident)  # thread names repeat across executors; idents do not

    assert names == [asyncio.run(go())]
    thread.shutdown()
