"""``inflight demo``: start the stack, send concurrent real prompts through the
edge (one over gRPC, the rest over REST), print the streamed answers with TTFT
and tokens/s, and stop."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common.promtext import sample_sum
from stack.clients import StreamResult, grpc_chat_stream, rest_chat_stream
from stack.stack import Stack, StackSettings

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clean Python code.",
)


async def run_prompts(endpoints: dict[str, str], api_key: str, prompts=DEMO_PROMPTS,
                      max_tokens: int = 96) -> list[StreamResult]:
    """Send ``prompts`` concurrently: the first over gRPC, the others over REST (SSE)."""
    tasks = [grpc_chat_stream(endpoints["grpc"], api_key, prompts[0], max_tokens=max_tokens)]
    tasks += [rest_chat_stream(endpoints["rest"], api_key, p, max_tokens=max_tokens) for p in prompts[1:]]
    return list(await asyncio.gather(*tasks))


def print_results(results: list[StreamResult], wall_s: float) -> None:
    """Print each answer with its TTFT, decode tokens/s and finish reason."""
    for i, r in enumerate(results, 1):
        print(f"\n[{i}] {r.transport.upper()}  Q: {r.prompt}")
        if r.error:
            print(f"    error: {r.error}")
            continue
        print("    A: " + r.text.strip().replace("\n", "\n       "))
        ttft = f"{r.ttft_s * 1000:.0f} ms" if r.ttft_s is not None else "n/a"
        print(f"    TTFT {ttft} · {r.completion_tokens} tokens · {r.tokens_per_s:.1f} tok/s"
              f" · e2e {r.e2e_s:.2f} s · finish {r.finish_reason}")
    total = sum(r.completion_tokens for r in results)
    print(f"\n{len(results)} concurrent requests, {total} tokens in {wall_s:.2f} s "
          f"= {total / wall_s:.1f} tok/s aggregate")


def worker_summary(metrics_url: str) -> str:
    """One line from the worker's /metrics: prefix-cache hit ratio, preemptions, KV usage."""
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError as exc:
        return f"worker metrics unavailable: {exc}"

    queries = sample_sum(text, "inflight_prefix_cache_queries_total")
    hits = sample_sum(text, "inflight_prefix_cache_hits_total")
    ratio = hits / queries if queries else 0.0
    return (f"worker: prefix-cache hit ratio {ratio:.0%} ({hits:.0f}/{queries:.0f} prompt tokens) · "
            f"preemptions {sample_sum(text, 'inflight_preemptions_total'):.0f} · "
            f"KV fragmentation {sample_sum(text, 'inflight_kv_fragmentation'):.0%}")


def demo(settings: StackSettings | None = None) -> int:
    """Start the stack of ``settings`` (default: every default, logs in a new temp dir),
    send the demo prompts, stop; returns a process exit code (0 when every answer arrived)."""
    settings = settings or StackSettings(run_dir=Path(tempfile.mkdtemp(prefix="inflight-demo-")))
    print(f"starting the stack (logs in {settings.run_dir}) …", flush=True)
    try:
        return _run(Stack(settings))
    except RuntimeError as exc:  # a process exited or never got ready: its log's tail says why
        print(f"inflight demo: the stack did not start: {exc}", file=sys.stderr)
        return 1


def _run(stack: Stack) -> int:
    """Start ``stack``, send the demo prompts, stop; the exit code (0: every answer arrived).

    Raises:
        RuntimeError: the stack did not start."""
    with stack:
        key = stack.create_key(tenant="demo", name="inflight demo")
        endpoints = stack.endpoints()
        via = "nginx" if stack.has_edge else "the gateway (nginx not installed)"
        print(f"ready: REST {endpoints['rest']} · gRPC {endpoints['grpc']} (through {via})")
        print(f"sending {len(DEMO_PROMPTS)} concurrent prompts …", flush=True)
        start = time.perf_counter()
        results = asyncio.run(run_prompts(endpoints, key))
        print_results(results, time.perf_counter() - start)
        print(worker_summary(endpoints["worker_metrics"]))
    return 0 if all(r.error is None and r.text for r in results) else 1
