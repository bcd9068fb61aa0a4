"""The one thread that runs the worker's torch work: model load, warm-up and every step.

PyTorch's CPU wheels for Linux parallelize with OpenMP (libgomp), which keeps
one team of threads for each thread that enters a parallel region. If the
asyncio thread loaded the model and warmed it up while another thread ran the
steps, the process would hold two teams: more OpenMP threads than cores on a
small machine. The GNU libgomp manual (``GOMP_SPINCOUNT``) says that a thread
waiting at a barrier then spins 100 times instead of 300,000 before it sleeps,
so every parallel op of a step would pay futex wake-ups; the measurement below
fits that (raising ``GOMP_SPINCOUNT`` did not help, as the manual implies).

Measured on 2 cores (``python -m bench.openmp_teams``, bench/RESULTS.md run 12):
the same continuous-batching run of SmolLM2 with the steps in a second thread made
more tokens/s on more of the cores with load and warm-up in that thread too than with
them on the main thread, the rest of the machine idle.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

#: Python name of the thread (``threading.current_thread().name`` starts with it).
THREAD_NAME = "engine"


class EngineThread:
    """A single worker thread for everything that computes with torch.

    Calls run one at a time, in submission order. The engine is touched from
    the asyncio thread only between calls, so it needs no lock.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the engine thread; its result, or its exception raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        """Stop taking calls; a call still running finishes in the background."""
        self._executor.shutdown(wait=False)
