"""``--target stack``: the whole stack (nginx → gateway → Redis → worker),
started per batching mode with :class:`stack.stack.Stack` or reached at
``--url``/``--grpc``, driven over REST (SSE) or gRPC with ``ignore_eos``. All
requests of a run share one gRPC channel (HTTP/2 streams) or one HTTP client
(its connection pool), as a client application would.

Running sequences over time come from scraping the worker's
``inflight_requests_running`` gauge (``/metrics``) every ``scrape_s``
seconds; without a metrics URL they are counted client-side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from bench.driver import drive
from bench.metrics import RunResult, occupancy_from_records
from bench.workloads import BenchRequest
from stack.clients import STREAM_TIMEOUT_S, StreamResult, grpc_chat_stream, rest_chat_stream
from common.promtext import sample_sum
from common.worker_options import WorkerOptions

#: Edge limits lifted for load generation (requests/s and burst; the article's 10 r/s would reject the load).
OPEN_EDGE = {"ip_rate": 10000, "ip_burst": 10000, "key_rate": 10000, "key_burst": 10000, "key_conns": 4096}


@dataclass(frozen=True)
class StackTarget:
    """Where to send: rest (base URL) or grpc (host:port) per ``transport``; api_key; metrics_url or None;
    stream_interval: the worker's tokens per streamed chunk, where known (for the report)."""

    transport: str
    rest: str
    grpc: str
    api_key: str
    metrics_url: str | None = None
    stream_interval: int = 1


#: The worker options a bench stack's worker is started with (the rest: the worker's defaults).
STACK_WORKER_OPTIONS = ("batching", "max_batch_size", "device", "dtype", "kv_cache_dtype", "quantization",
                        "dense_weights_min_rows", "stream_interval", "max_num_batched_tokens")


@contextmanager
def started_stack(options: WorkerOptions):
    """A fresh local stack in ``options.batching`` mode (unlimited queue depth, edge limits
    lifted), its worker on the CPU (where the engine target runs) with ``options``'
    :data:`STACK_WORKER_OPTIONS` (a None ``max_num_batched_tokens``: the worker's default) and
    model; yields a StackTarget for REST."""
    from stack.stack import Stack, StackSettings

    options = options.replace(device="cpu")
    os.environ.setdefault("INFLIGHT_GATEWAY_MAX_QUEUE_DEPTH", "0")
    run_dir = Path(tempfile.mkdtemp(prefix=f"inflight-bench-{options.batching}-"))
    ports = dict(zip(("rest_port", "grpc_port", "link_port", "worker_health_port", "worker_grpc_health_port",
                      "edge_rest_port", "edge_grpc_port"), free_ports(7)))
    settings = StackSettings(run_dir=run_dir, model=options.model, edge_overrides=OPEN_EDGE, **ports,
                             worker_args=tuple(options.to_argv(STACK_WORKER_OPTIONS)))
    with Stack(settings) as stack:
        ends = stack.endpoints()
        yield StackTarget("rest", ends["rest"], ends["grpc"], stack.create_key("bench", "inflight bench"),
                          ends["worker_metrics"], options.stream_interval)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (others may run stacks on the default ports)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _sender(target: StackTarget, channel: grpc.aio.Channel | None, client: httpx.AsyncClient | None):
    async def send(req: BenchRequest) -> StreamResult:
        if target.transport == "grpc":
            return await grpc_chat_stream(target.grpc, target.api_key, req.prompt,
                                          max_tokens=req.output_tokens, ignore_eos=True, channel=channel)
        return await rest_chat_stream(target.rest, target.api_key, req.prompt, max_tokens=req.output_tokens,
                                      extra={"ignore_eos": True}, client=client)
    return send


async def _scrape(url: str, t0: float, samples: list, scrape_s: float) -> None:
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            try:
                text = (await client.get(url)).text
                if "inflight_requests_running" in text:
                    samples.append((time.perf_counter() - t0, int(sample_sum(text, "inflight_requests_running"))))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(scrape_s)


async def _run(target: StackTarget, requests: list[BenchRequest], scrape_s: float):
    samples: list[tuple[float, int]] = []
    scraper = None
    if target.metrics_url:
        scraper = asyncio.create_task(_scrape(target.metrics_url, time.perf_counter(), samples, scrape_s))
    try:
        async with contextlib.AsyncExitStack() as shared:
            channel = client = None
            if target.transport == "grpc":
                channel = await shared.enter_async_context(grpc.aio.insecure_channel(target.grpc))
            else:
                client = await shared.enter_async_context(
                    httpx.AsyncClient(timeout=STREAM_TIMEOUT_S, limits=httpx.Limits(max_connections=None)))
            records = await drive(_sender(target, channel, client), requests)
    finally:
        if scraper:
            scraper.cancel()
    return records, samples


def run(target: StackTarget, requests: list[BenchRequest], mode: str, max_batch_size: int, dtype: str,
        scrape_s: float = 0.5) -> RunResult:
    """Drive ``requests`` through the stack at ``target``."""
    records, samples = asyncio.run(_run(target, requests, scrape_s))
    note = f"{target.transport}; running from worker /metrics every {scrape_s} s"
    if len(samples) < 2:
        samples, note = occupancy_from_records(records), f"{target.transport}; running counted client-side"
    if target.stream_interval > 1:
        note += f"; stream interval {target.stream_interval} tokens (ITL per chunk)"
    return RunResult("inflight-stack", mode, records, samples, max_batch_size, dtype, note)
