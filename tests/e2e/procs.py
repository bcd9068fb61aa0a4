"""Helpers the process-level e2e tests share: API keys, cleanup, and streams that
trigger a fault once every client is mid-stream."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterable

from stack.clients import StreamResult


def create_key(redis_url: str) -> str:
    """A new API key in the Redis at ``redis_url``, through the real ``inflight keys`` CLI."""
    return subprocess.run([sys.executable, "-m", "inflight.cli", "keys", "create", "--redis-url", redis_url,
                           "--quiet"], capture_output=True, text=True, check=True).stdout.strip()


def kill_all(procs: Iterable[subprocess.Popen | None]) -> None:
    """SIGKILL and reap every process still running."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


async def stream_all(results: list[StreamResult], send: Callable[[int, StreamResult], Awaitable[StreamResult]],
                     on_streaming: Callable[[], object] | None = None) -> list[StreamResult]:
    """Start ``send(i, results[i])`` for every result at once; once each result has text,
    call ``on_streaming()`` (a fault: kill or drain a worker; may be async); return all
    results when every stream ended.

    Raises:
        AssertionError: a stream ended before all of them had text.
    """
    tasks = [asyncio.ensure_future(send(i, r)) for i, r in enumerate(results)]
    if on_streaming is not None:
        while not all(r.text for r in results):
            assert not any(t.done() for t in tasks), [t.result().error for t in tasks if t.done()]
            await asyncio.sleep(0.01)
        outcome = on_streaming()
        if inspect.isawaitable(outcome):
            await outcome
    return await asyncio.gather(*tasks)
