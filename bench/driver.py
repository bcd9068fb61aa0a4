"""Open/closed-loop driver for systems reached over the network (the stack, llama-server).

Each request is sent as its own asyncio task at its arrival time (vLLM's
``benchmark_serving.py`` does the same); the client-measured stream
(:class:`stack.clients.StreamResult`, times relative to the send) is
shifted onto the run's clock.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from bench.metrics import RequestRecord
from bench.workloads import BenchRequest
from stack.clients import StreamResult

Send = Callable[[BenchRequest], Awaitable[StreamResult]]


async def drive(send: Send, requests: list[BenchRequest]) -> list[RequestRecord]:
    """Send every request at its arrival time (seconds after now); return one record each, in order."""
    t0 = time.perf_counter()

    async def one(req: BenchRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
        sent = time.perf_counter() - t0
        try:
            result = await send(req)
        except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
            return RequestRecord(req.request_id, req.arrival_s, req.output_tokens, end_s=time.perf_counter() - t0,
                                 error=f"{type(exc).__name__}: {exc}")
        return to_record(req, result, sent)

    return list(await asyncio.gather(*(one(r) for r in requests)))


def to_record(req: BenchRequest, result: StreamResult, sent_s: float) -> RequestRecord:
    """A record on the run's clock from a stream measured from ``sent_s`` seconds."""
    times = [sent_s + t for t in result.token_times]
    error = result.error
    if error is None and result.finish_reason not in (None, "length"):
        error = f"finished with {result.finish_reason!r} before max_tokens"
    return RequestRecord(req.request_id, req.arrival_s, req.output_tokens, times, sent_s + result.e2e_s,
                         result.completion_tokens or len(times), error)
