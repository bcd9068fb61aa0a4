"""SIGTERM drains a worker: it stops pulling, finishes what it runs, then exits."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import pytest

from stack.clients import StreamResult, rest_chat_stream
from common.promtext import sample_sum
from tests.e2e.procs import create_key, kill_all, stream_all
from tests.e2e.test_readiness import spawn, status, wait_until
from tests.helpers.redis_server import free_port, start_redis

pytestmark = pytest.mark.e2e


def test_sigterm_finishes_running_requests(tmp_path):
    server = start_redis()
    rest, health = free_port(), free_port()
    gateway = spawn(["gateway", "--redis-url", server.url, "--rest-port", str(rest), "--grpc-port",
                     str(free_port()), "--link-port", str(free_port())], tmp_path / "gateway.log")
    worker = spawn(["worker", "--redis-url", server.url, "--health-port", str(health), "--grpc-health-port", "0",
                    "--dtype", "float32", "--kv-cache-mib", "128", "--warmup-tokens", "16"], tmp_path / "worker.log")
    try:
        wait_until(lambda: status(f"http://127.0.0.1:{rest}/ready") == 200, 120, "the stack")
        key = create_key(server.url)

        async def scenario():
            base = f"http://127.0.0.1:{rest}"
            tasks = [asyncio.ensure_future(rest_chat_stream(base, key, f"Count to {n}.", max_tokens=48,
                                                            extra={"ignore_eos": True})) for n in (10, 20, 30)]
            while worker_running(health) < 3:
                await asyncio.sleep(0.05)
            worker.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        results = asyncio.run(asyncio.wait_for(scenario(), 120))
        for r in results:
            assert r.error is None, r.error
            assert r.completion_tokens == 48 and r.finish_reason == "length"
        assert worker.wait(30) == 0
    finally:
        kill_all((worker, gateway))
        server.stop()


def worker_running(health_port: int) -> float:
    """inflight_requests_running from the worker's /metrics (0 when unreadable)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{health_port}/metrics", timeout=2).read().decode()
    except OSError:
        return 0.0
    return sample_sum(text, "inflight_requests_running")


def test_sigterm_hands_back_what_outlives_the_grace_period(tmp_path):
    """Drain grace 0.5 s, requests that need far longer: the worker hands them back and
    exits 0; a second worker resumes them and each client gets exactly the text of an
    uninterrupted greedy run."""
    server = start_redis()
    rest = free_port()
    gateway = spawn(["gateway", "--redis-url", server.url, "--rest-port", str(rest), "--grpc-port",
                     str(free_port()), "--link-port", str(free_port())], tmp_path / "gateway.log")

    def worker(name: str) -> subprocess.Popen:
        return spawn(["worker", "--redis-url", server.url, "--health-port", str(free_port()),
                      "--grpc-health-port", "0", "--dtype", "float32", "--kv-cache-mib", "128",
                      "--warmup-tokens", "16", "--drain-grace-s", "0.5"], tmp_path / f"{name}.log")

    procs = [gateway, worker("worker-a")]
    base = f"http://127.0.0.1:{rest}"
    try:
        wait_until(lambda: status(f"{base}/ready") == 200, 120, "the stack")
        key = create_key(server.url)
        prompts = [f"Write a long story about {thing}." for thing in ("a fox", "the rain", "a ship")]

        async def send(on_streaming=None):
            return await stream_all(
                [StreamResult("rest", p) for p in prompts],
                lambda i, r: rest_chat_stream(base, key, prompts[i], max_tokens=96, result=r,
                                              extra={"ignore_eos": True}), on_streaming)

        reference = asyncio.run(asyncio.wait_for(send(), 120))

        def drain_and_replace():
            procs[1].send_signal(signal.SIGTERM)
            procs.append(worker("worker-b"))

        resumed = asyncio.run(asyncio.wait_for(send(drain_and_replace), 180))
        assert procs[1].wait(30) == 0
        assert "handed 3 unfinished request(s) back" in (tmp_path / "worker-a.log").read_text()
        for ref, got in zip(reference, resumed):
            assert got.error is None, got.error
            assert got.completion_tokens == 96 and got.text == ref.text
    finally:
        kill_all(procs)
        server.stop()
