"""LeaseWatch (worker/serve/service.py): a process frozen past its lease is told so once it
wakes, a long engine step on another thread is not a freeze, and a fence starts a new lease."""

from __future__ import annotations

import asyncio
import time

from worker.serve.service import LeaseWatch


def test_a_frozen_loop_has_lost_its_lease_and_a_busy_thread_has_not():
    async def run():
        watch = LeaseWatch(lease_s=0.3, tick_s=0.05)
        watch.start()
        await asyncio.to_thread(time.sleep, 0.6)  # a long step on the engine thread: the loop still ticks
        assert not watch.lost()
        time.sleep(0.5)  # the whole loop stands still (what SIGSTOP does to the process)
        assert watch.lost()
        await asyncio.sleep(0.1)  # a late tick does not hide the gap
        assert watch.lost()
        assert watch.renew() > 0.5
        assert not watch.lost()
        watch.stop()

    asyncio.run(run())


def test_a_worker_frozen_past_its_lease_sends_nothing_more_and_frees_its_runs(redis_url):
    """The whole loop stands still past the lease mid-stream (what SIGSTOP does): on waking the
    worker sends no more output for the running request, aborts it (blocks freed, no Finished:
    its gateway queued a continuation elsewhere) and closes its link."""
    from tests.worker.serve.test_worker_service import Harness, _slow_steps, _until, run

    async def scenario():
        async with Harness(redis_url) as h:
            # a long lease while r1 starts (a loaded machine's loop can stall seconds at setup, which
            # fenced the worker before r1 ran in CI); it drops to 1 s only just before the freeze,
            # with no await between, so no stall but the freeze itself can cross it
            h.service._lease.lease_s, h.service._lease.tick_s = 600.0, 0.05
            await asyncio.sleep(0.6)  # the first tick (0.5 s) is past: ticks now every 50 ms
            _slow_steps(h.engine, 0.02)
            await h.enqueue("r1", max_tokens=200)  # 20 ms a step: 4 s to run, past the freeze
            await _until(lambda: sum(h.gateway.delta_tokens["r1"]) > 5)
            sent = sum(h.gateway.delta_tokens["r1"])
            h.service._lease.lease_s = 1.0
            time.sleep(2.5)  # frozen past the lease: no tick, no send
            await _until(lambda: not h.engine.has_unfinished(), 5)
            await _until(lambda: h.gateway.links_closed >= 1, 5)
            await asyncio.sleep(0.2)
            assert sum(h.gateway.delta_tokens["r1"]) == sent  # nothing of the frozen run reached the gateway
            assert "r1" not in h.gateway.finished

    run(scenario())
