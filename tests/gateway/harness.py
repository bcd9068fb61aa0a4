"""Runs a real gateway (``gateway.main.serve``) in a background thread for tests."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import httpx

from gateway.main import serve
from gateway.settings import GatewaySettings
from tests.gateway.fake_tokenizer import CharTokenizer
from tests.helpers.redis_server import free_port


@dataclass
class RunningGateway:
    settings: GatewaySettings
    loop: asyncio.AbstractEventLoop
    task: asyncio.Future
    thread: threading.Thread

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.rest_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.settings.grpc_port}"

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)


def start_gateway(redis_url: str, tokenizer=None, tracer=None, tokenizers=None, **overrides) -> RunningGateway:
    """Start ``serve`` on free loopback ports with ``tokenizer`` (default a :class:`CharTokenizer`;
    ``tokenizers``: model name -> tokenizer, for the models ``overrides`` configure)
    and ``tracer`` (an OpenTelemetry tracer; default: tracing as the environment says, i.e. off);
    waits for /health. ``require_worker`` is off unless ``overrides`` turn it on
    (tests/gateway/admission/test_admission.py).

    A port taken by another process between :func:`free_port` and the bind ends ``serve``
    at once (uvicorn exits on EADDRINUSE): then it starts again on other free ports, up to
    3 times.

    Raises:
        RuntimeError: when it is not up within 10 s, or its ports were taken 3 times.
    """
    for _ in range(3):
        running = _start_once(redis_url, tokenizer, tracer, overrides, tokenizers)
        if running is not None:
            return running
    raise RuntimeError("gateway did not start: serve ended 3 times before /health answered (a port taken, or see the log)")


def _start_once(redis_url: str, tokenizer, tracer, overrides: dict, tokenizers=None) -> RunningGateway | None:
    """One try of :func:`start_gateway`: None when ``serve`` ended before /health answered."""
    link_port = free_port()
    settings = GatewaySettings(**{
        "redis_url": redis_url, "rest_host": "127.0.0.1", "rest_port": free_port(), "grpc_host": "127.0.0.1",
        "grpc_port": free_port(), "link_host": "127.0.0.1", "link_port": link_port,
        "served_model_name": "test-model", "redis_timeout_s": 0.5, "grace_s": 0.5,
        # tests FLUSHALL between cases, which drops the fake worker's heartbeat for up to 0.2 s
        "require_worker": False, **overrides})
    loop = asyncio.new_event_loop()
    holder: dict = {}

    def main() -> None:
        asyncio.set_event_loop(loop)
        holder["task"] = loop.create_task(serve(settings, tokenizer=tokenizer or CharTokenizer(), tracer=tracer,
                                                tokenizers=tokenizers))
        try:
            loop.run_until_complete(holder["task"])
        except BaseException:
            pass
        finally:
            loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{settings.rest_port}/health", timeout=0.5).status_code == 200:
                return RunningGateway(settings, loop, holder["task"], thread)
        except httpx.HTTPError:
            if not thread.is_alive():  # serve ended: a port was taken
                return None
            time.sleep(0.05)
    raise RuntimeError("gateway did not start")
