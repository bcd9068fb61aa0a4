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
