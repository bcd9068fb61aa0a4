"""A worker killed with SIGKILL mid-stream costs its clients nothing (issue 8,
DESIGN.md "worker dies after XACK"): the gateway re-queues each request as a
continuation, a second worker finishes all 16, and every client's full text is
exactly what an uninterrupted greedy run gives, nothing repeated or lost."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import pytest

from stack.clients import StreamResult, grpc_chat_stream, rest_chat_stream
from tests.e2e.procs import create_key, kill_all, stream_all
from tests.e2e.test_readiness import spawn, status, wait_until
from tests.helpers.redis_server import free_port, start_redis

pytestmark = pytest.mark.e2e
NUM_REQUESTS, MAX_TOKENS = 16, 40
PROMPTS = [f"Tell me fact number {n} about {topic}." for n, topic in
           enumerate(["the sea", "Paris", "bees", "the moon"] * 4)]


def _worker(redis_url: str, log_path) -> subprocess.Popen:
    return spawn(["worker", "--redis-url", redis_url, "--health-port", str(free_port()),
                  "--grpc-health-port", str(free_port()), "--dtype", "float32", "--kv-cache-mib", "128",
                  "--warmup-tokens", "16"], log_path)


async def _stream(rest: str, grpc_addr: str, key: str, i: int, result: StreamResult) -> StreamResult:
    if i % 2:
        return await grpc_chat_stream(grpc_addr, key, PROMPTS[i], MAX_TOKENS, ignore_eos=True, result=result)
    return await rest_chat_stream(rest, key, PROMPTS[i], MAX_TOKENS, extra={"ignore_eos": True}, result=result)


async def _all(rest: str, grpc_addr: str, key: str, on_streaming=None) -> list[StreamResult]:
    """Send every prompt at once (even: REST, odd: gRPC); see ``stream_all``."""
    results = [StreamResult("rest" if i % 2 == 0 else "grpc", p) for i, p in enumerate(PROMPTS)]
    return await stream_all(results, lambda i, r: _stream(rest, grpc_addr, key, i, r), on_streaming)


def test_sigkill_mid_stream_a_second_worker_finishes_every_request(tmp_path):
    server = start_redis()
    rest_port, grpc_port = free_port(), free_port()
    gateway = spawn(["gateway", "--redis-url", server.url, "--rest-port", str(rest_port), "--grpc-port",
                     str(grpc_port), "--link-port", str(free_port())], tmp_path / "gateway.log")
    first = _worker(server.url, tmp_path / "worker-a.log")
    procs = [gateway, first]
    rest, grpc_addr = f"http://127.0.0.1:{rest_port}", f"127.0.0.1:{grpc_port}"
    try:
        wait_until(lambda: status(f"{rest}/ready") == 200, 120, "the stack")
        key = create_key(server.url)
        reference = asyncio.run(asyncio.wait_for(_all(rest, grpc_addr, key), 180))
        assert all(r.error is None and r.completion_tokens == MAX_TOKENS for r in reference), reference

        async def crash():
            first.send_signal(signal.SIGKILL)
            procs.append(_worker(server.url, tmp_path / "worker-b.log"))

        resumed = asyncio.run(asyncio.wait_for(_all(rest, grpc_addr, key, on_streaming=crash), 240))
        assert first.wait(10) == -signal.SIGKILL
        for ref, got in zip(reference, resumed):
            assert got.error is None, got.error
            assert got.finish_reason == "length" and got.completion_tokens == MAX_TOKENS
            assert got.text == ref.text, (got.prompt, got.text, ref.text)
        # the second worker really did the rest: every request was continued
        gateway_log = (tmp_path / "gateway.log").read_text()
        assert gateway_log.count("continuation queued") == NUM_REQUESTS, gateway_log[-2000:]
    finally:
        kill_all(procs)
        server.stop()
