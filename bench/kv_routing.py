"""KV-cache-aware routing against the shared stream, side by side in one run.

``python -m bench.kv_routing`` starts, for each (workload, router mode), a fresh stack on
this machine: an embedded Redis, one gateway (``--router-mode kv`` or ``shared``) and two
workers (SmolLM2-135M on the CPU, one thread each, ``--num-blocks`` KV blocks each: room
for a few tenants' system prompts, not all eight), and drives it over REST (SSE) with
Poisson arrivals.

Workloads:
* ``tenants``: 8 tenants, each with its own system prompt of about ``--system-tokens``
  tokens, and short questions (bench/prompts.jsonl); each request picks a tenant at random.
* ``uniform``: every request has a system prompt of its own (no prefix shared beyond the
  chat template's first tokens): routing has nothing to win there and must cost nothing.

Per row: prefix-cache hit ratio (prompt tokens served from the workers' prefix caches over
prompt tokens looked up, from both workers' ``/metrics``), TTFT p50/p99, throughput
(completed requests and output tokens per second over the run), the share of requests
the router put on a worker's own stream, and how the requests split between the workers.
Prints a Markdown table and writes ``bench/results/<date>-<time>-kv-routing.csv``. Benchmarks on this
machine are noisy (other jobs share its CPUs): compare the rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.metrics import percentiles
from common.promtext import sample_sum
from common.worker_options import WorkerOptions, add_worker_options
from stack.clients import STREAM_TIMEOUT_S, StreamResult, rest_chat_stream

ROOT = Path(__file__).resolve().parent
WORDS = ("account billing policy refund customer order shipping warehouse contract invoice support ticket "
         "escalation priority region latency service level agreement incident report quarterly review "
         "compliance privacy retention audit partner vendor catalogue product feature release roadmap "
         "pricing discount subscription renewal cancellation onboarding training handbook procedure").split()


@dataclass(frozen=True)
class Row:
    """One (workload, router mode) run; times in seconds, rates per second."""

    workload: str
    router: str
    requests: int
    errors: int
    prefix_hit_ratio: float
    ttft_p50_s: float
    ttft_p99_s: float
    req_per_s: float
    output_tok_per_s: float
    routed_to_worker: float
    split: str
    makespan_s: float


def system_prompt(tokenizer, seed: int, tokens: int) -> str:
    """A tenant's house rules: seeded sentences until the text has about ``tokens`` tokens."""
    rng = random.Random(seed)
    lines = [f"You are the assistant of company number {seed}. Follow these house rules."]
    while len(tokenizer.encode(" ".join(lines))) < tokens:
        words = " ".join(rng.choice(WORDS) for _ in range(12))
        lines.append(f"Rule {len(lines)}: {words}.")
    return " ".join(lines)


def questions() -> list[str]:
    """The short user questions of bench/prompts.jsonl."""
    return [json.loads(line)["prompt"] for line in (ROOT / "prompts.jsonl").read_text().splitlines() if line]


def workload(kind: str, tokenizer, n: int, rate: float, tenants: int, system_tokens: int,
             seed: int) -> list[tuple[float, list[dict]]]:
    """``n`` (arrival time s, chat messages) with Poisson arrivals at ``rate`` req/s."""
    rng = random.Random(seed)
    asks = questions()
    systems = [system_prompt(tokenizer, 1000 + t, system_tokens) for t in range(tenants)]
    out, t = [], 0.0
    for i in range(n):
        system = systems[rng.randrange(tenants)] if kind == "tenants" else \
            system_prompt(tokenizer, 10_000 + seed * 1000 + i, system_tokens)
        out.append((t, [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(asks)}]))
        t += rng.expovariate(rate)
    return out


async def drive(url: str, key: str, requests: list[tuple[float, list[dict]]], max_tokens: int) -> list[StreamResult]:
    """Send each request at its arrival time (streams overlap); wait for all."""
    async with httpx.AsyncClient(timeout=STREAM_TIMEOUT_S, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(at: float, messages: list[dict]) -> StreamResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            return await rest_chat_stream(url, key, "", max_tokens=max_tokens, client=client,
                                          extra={"messages": messages, "ignore_eos": True})
        return list(await asyncio.gather(*(one(at, m) for at, m in requests)))


def scrape(url: str) -> str:
    """The Prometheus text of ``url`` ("" when it does not answer)."""
    try:
        return httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return ""


def run_phase(kind: str, router: str, args, tokenizer) -> Row:
    """One fresh stack (gateway + two workers) in ``router`` mode, driven with ``kind``."""
    from bench.targets.stack import free_ports
    from stack.stack import Stack, StackSettings

    os.environ["INFLIGHT_GATEWAY_MAX_QUEUE_DEPTH"] = "0"
    ports = free_ports(7)
    run_dir = Path(tempfile.mkdtemp(prefix=f"inflight-kvr-{kind}-{router}-"))
    options = WorkerOptions.from_args(args).replace(device="cpu", warmup_tokens=64)
    worker_args = tuple(options.to_argv(("device", "threads", "num_blocks", "max_batch_size", "warmup_tokens")))
    settings = StackSettings(run_dir=run_dir, use_nginx=False, rest_port=ports[0], grpc_port=ports[1],
                             link_port=ports[2], worker_health_port=ports[3], worker_grpc_health_port=ports[4],
                             extra_workers=((ports[5], ports[6]),), worker_args=worker_args,
                             gateway_args=("--router-mode", router))
    requests = workload(kind, tokenizer, args.num_requests, args.rate, args.tenants, args.system_tokens, args.seed)
    with Stack(settings) as stack:
        ends = stack.endpoints()
        key = stack.create_key("bench", "kv routing")
        metrics = [ends["worker_metrics"], f"http://127.0.0.1:{ports[5]}/metrics"]
        before = [scrape(m) for m in metrics]
        started = time.perf_counter()
        results = asyncio.run(drive(ends["gateway_rest"], key, requests, args.max_tokens))
        makespan = time.perf_counter() - started
        after = [scrape(m) for m in metrics]
        gateway = scrape(f"{ends['gateway_rest']}/metrics")

    def delta(name: str, i: int) -> float:
        return sample_sum(after[i], name) - sample_sum(before[i], name)
    hits = sum(delta("inflight_prefix_cache_hits_total", i) for i in range(2))
    queries = sum(delta("inflight_prefix_cache_queries_total", i) for i in range(2))
    per_worker = [delta("inflight_generation_tokens_total", i) / max(1, args.max_tokens) for i in range(2)]
    ok = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = percentiles([r.ttft_s for r in ok])
    routed = sample_sum(gateway, "inflight_gateway_routed_total", {"target": "worker"})
    return Row(kind, router, len(results), len(results) - len(ok), hits / queries if queries else 0.0,
               ttft.p50, ttft.p99, len(ok) / makespan, sum(r.completion_tokens for r in ok) / makespan,
               routed / len(results), "/".join(f"{w:.0f}" for w in per_worker), makespan)


def table(rows: list[Row]) -> str:
    """The Markdown table of a run."""
    head = ("| workload | router | requests | errors | prefix hit % | TTFT p50 s | TTFT p99 s | req/s | out tok/s "
            "| routed to a worker % | requests per worker |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r.workload} | {r.router} | {r.requests} | {r.errors} | {100 * r.prefix_hit_ratio:.1f} | "
             f"{r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | {r.req_per_s:.3f} | {r.output_tok_per_s:.1f} | "
             f"{100 * r.routed_to_worker:.0f} | {r.split} |" for r in rows]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    """Run every (workload, router) pair, print the table, write the CSV."""
    p = argparse.ArgumentParser(prog="python -m bench.kv_routing", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="tenants,uniform")
    p.add_argument("--routers", default="shared,kv", help="router modes, run in this order per workload")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, requests per second")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    add_worker_options(p, ["num_blocks", "max_batch_size", "threads"],  # the workers' (common/worker_options.py)
                       {"num_blocks": {"default": 400, "help": "KV blocks per worker (16 tokens each)"},
                        "max_batch_size": {"default": 8, "help": None},
                        "threads": {"type": int, "default": 1, "help": "CPU threads per worker"}})
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-kv-routing.csv"))
    args = p.parse_args(argv)
    from common.model_files import resolve_model_path
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(None))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()  # at the start: the stacks run the tree as it is now
    rows = []
    for kind in args.workloads.split(","):
        for router in args.routers.split(","):
            rows.append(run_phase(kind, router, args, tokenizer))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\ncommit {commit}; {os.cpu_count()} CPUs shared with other jobs; "
          f"{args.num_requests} requests per row at {args.rate} req/s; {args.num_blocks} KV blocks per worker\n")
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*asdict(rows[0]), "commit", "args"])
        writer.writeheader()
        for r in rows:
            writer.writerow({**asdict(r), "commit": commit, "args": " ".join(sys.argv[1:] if argv is None else argv)})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
