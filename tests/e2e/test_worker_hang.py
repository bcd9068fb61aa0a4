"""A worker that hangs (SIGSTOP) instead of dying costs its clients nothing (issue 49 items 1
and 4): the gateway's keepalive pings on the link go unanswered, the link is declared lost
(``--link-keepalive``), its requests continue on the other worker, and when the stopped
worker wakes (SIGCONT) it delivers nothing: every client's text is an unbroken greedy run's,
and the gateway rejected no output of a stale link (its link is gone; worker/serve/service.py
fences a worker frozen past its lease)."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request

import pytest

from common.promtext import sample_sum
from stack.clients import StreamResult, rest_chat_stream
from tests.e2e.procs import create_key, kill_all, stream_all
from tests.e2e.test_readiness import spawn, status, wait_until
from tests.helpers.redis_server import free_port, start_redis

pytestmark = pytest.mark.e2e
# Long enough that no stream ends before all four stream: a worker that pulled one request could
# finish its 40 tokens while the other still prefilled its three (a full-suite run on Zen 3).
MAX_TOKENS = 120
PROMPTS = [f"Tell me fact number {n} about {topic}." for n, topic in enumerate(["the sea", "Paris", "bees", "the moon"])]


def _metric(url: str, name: str) -> float:
    return sample_sum(urllib.request.urlopen(url, timeout=5).read().decode(), name)


async def _all(rest: str, key: str, on_streaming=None) -> list[StreamResult]:
    results = [StreamResult("rest", p) for p in PROMPTS]
    return await stream_all(results, lambda i, r: rest_chat_stream(
        rest, key, PROMPTS[i], MAX_TOKENS, extra={"ignore_eos": True}, result=r), on_streaming)


def test_a_stopped_workers_requests_are_taken_over_and_it_delivers_nothing_on_waking(tmp_path):
    server = start_redis()
    rest_port = free_port()
    healths = [free_port(), free_port()]
    gateway = spawn(["gateway", "--redis-url", server.url, "--rest-port", str(rest_port), "--grpc-port",
                     str(free_port()), "--link-port", str(free_port()), "--link-keepalive", "1"],
                    tmp_path / "gateway.log")
    workers = [spawn(["worker", "--redis-url", server.url, "--health-port", str(h), "--grpc-health-port",
                      str(free_port()), "--dtype", "float32", "--kv-cache-mib", "64", "--warmup-tokens", "16",
                      # a worker may pull every request: with room to run them all at once, no
                      # stream waits for another to finish before the fault, which needs all streaming
                      "--max-batch-size", "4"], tmp_path / f"worker-{i}.log") for i, h in enumerate(healths)]
    procs = [gateway, *workers]
    rest = f"http://127.0.0.1:{rest_port}"
    try:
        for h in healths:
            wait_until(lambda: status(f"http://127.0.0.1:{h}/ready") == 200, 120, "the workers")
        wait_until(lambda: status(f"{rest}/ready") == 200, 60, "the gateway")
        key = create_key(server.url)
        reference = asyncio.run(asyncio.wait_for(_all(rest, key), 120))
        assert all(r.error is None and r.completion_tokens == MAX_TOKENS for r in reference), reference
        stopped: list[int] = []

        async def hang():
            running = [_metric(f"http://127.0.0.1:{h}/metrics", "inflight_requests_running") for h in healths]
            stopped.append(max(range(2), key=lambda i: running[i]))
            workers[stopped[0]].send_signal(signal.SIGSTOP)
            started = time.monotonic()
            while time.monotonic() - started < 4.0:  # past the link's keepalive (2 s), not its own lease
                await asyncio.sleep(0.1)
            workers[stopped[0]].send_signal(signal.SIGCONT)

        resumed = asyncio.run(asyncio.wait_for(_all(rest, key, on_streaming=hang), 180))
        for ref, got in zip(reference, resumed):
            assert got.error is None, got.error
            assert got.completion_tokens == MAX_TOKENS
            assert got.text == ref.text, (got.prompt, got.text, ref.text)  # no token twice, none lost
        log = (tmp_path / "gateway.log").read_text()
        assert log.count("continuation queued") >= 1, log[-2000:]
        assert _metric(f"{rest}/metrics", "inflight_gateway_link_rejections_total") == 0
        woken = f"http://127.0.0.1:{healths[stopped[0]]}/metrics"
        wait_until(lambda: _metric(woken, "inflight_requests_running") == 0, 5, "the woken worker to drop its runs")
        assert workers[stopped[0]].poll() is None  # it lives on and serves again
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        kill_all(procs)
        server.stop()
