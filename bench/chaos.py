"""Chaos soak: the whole fleet on this machine under Poisson load, with faults on a seeded
schedule, accounting for every request and every token (issue 49 items 1 and 3).

The fleet (``bench/chaos_fleet.py``): Redis primary + replica + three sentinels, two workers
(the default SmolLM2 model, ``--deterministic`` so a greedy answer is the same bits in any
batch), two gateways, nginx balancing over both. The load (``bench/chaos_load.py``): Poisson
arrivals at ``--rate`` over REST (the ``openai`` client: streams resumed with
``Last-Event-ID`` when broken, non-streaming, ``n`` = 2, structured outputs, cancellations) and
gRPC (streams resumed with ``Resume``, calls with a short deadline). The faults
(``bench/chaos_faults.py``): SIGKILL a worker, SIGSTOP one for 30 s, SIGKILL a gateway, SIGKILL
the Redis primary, a slow and a stalled reader, a KV-cache squeeze; a window each, scaled to
``--duration``. A probe request every second through nginx measures when new requests are
served again after each fault; the workers' and gateways' metrics every second give the
timeline (tok/s, queue depth, running sequences).

The report (``bench/chaos_report.py``): per fault window and in total, sent / completed /
cancelled / failed with a clear error / lost, tokens delivered twice (or wrong) and tokens
missing against an unbroken greedy reference of the same prompt (taken at the start, before
any fault), the time to recover per fault against its bound, the RSS of every process at
start and end, and one PNG timeline. Exit status 1 when a request was lost or a token was
extra or missing.

    inflight bench chaos --duration 1800 --seed 1
    python -m bench.chaos --duration 300 --rate 0.4 --tag smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import time

import httpx

from bench import chaos_load as load
from bench import chaos_report, report
from bench.chaos_faults import KINDS, SIGNALS, Fault, parse_kinds, schedule, signal_group
from bench.chaos_fleet import GATEWAYS, WORKERS, Fleet, start_fleet
from bench.chaos_load import ChaosRecord, Endpoints
from bench.options import add_out_option
from common.promtext import sample_sum
from common.worker_options import WorkerOptions, add_worker_options

PROMPTS = ["Tell me about the sea.", "Why is the sky blue?", "Describe a city at night.",
           "Write a short poem about bees."]
SQUEEZE_UNIT = "The tide comes in and the tide goes out along the grey stone wall. "


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m bench.chaos`` / ``inflight bench chaos``."""
    p = argparse.ArgumentParser(prog="inflight bench chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800.0, help="how long new requests are sent, seconds")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault schedule, its targets and the load")
    p.add_argument("--rate", type=float, default=0.4, help="mean arrival rate, requests/s (Poisson)")
    p.add_argument("--max-tokens", type=int, default=40, help="output tokens of the checked greedy requests")
    p.add_argument("--faults", type=_kinds, default=KINDS, metavar="KIND[,KIND...]",
                   help=f"which faults to do: all (default) or some of {', '.join(KINDS)}; one window each "
                   "per 150 s of the run per kind (e.g. --faults worker-kill --duration 300: two worker kills)")
    p.add_argument("--hold-s", type=float, default=30.0, help="how long a worker stays SIGSTOPped (at most "
                   "0.6 of its window)")
    p.add_argument("--stream-idle-timeout", type=float, default=15.0,
                   help="the gateways' --stream-idle-timeout, seconds (the stalled reader's bound)")
    p.add_argument("--request-timeout", type=float, default=180.0,
                   help="the gateways' request timeout (INFLIGHT_GATEWAY_REQUEST_TIMEOUT_S), seconds: a "
                   "request not finished by then gets a clear 504 / DEADLINE_EXCEEDED; one still open 60 s "
                   "later counts as lost (hung)")
    add_worker_options(p, ["model", "dtype", "kv_cache_mib", "max_batch_size", "threads"],
                       {"model": {"help": None}, "dtype": {"default": "float32", "choices": ["float32", "bfloat16"]},
                        "kv_cache_mib": {"default": 64, "help": None}, "max_batch_size": {"default": 16, "help": None},
                        "threads": {"default": 1, "help": "CPU threads of each worker (1: the two workers of a "
                                    "2-core machine do not fight over its cores; --deterministic fixes the count)"}})
    add_out_option(p)
    p.add_argument("--tag", default="", help="suffix of the output file names")
    return p


def _kinds(text: str) -> tuple[str, ...]:
    try:
        return parse_kinds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Chaos:
    """One run against a started ``fleet`` with the clients' ``ends``; see the module docstring."""

    def __init__(self, args: argparse.Namespace, fleet: Fleet, ends: Endpoints, faults: list[Fault]):
        self.args, self.fleet, self.ends, self.faults = args, fleet, ends, faults
        self.rng = random.Random(args.seed)
        self.records: list[ChaosRecord] = []
        self.samples: list[dict] = []
        self.probes: list[tuple[float, bool, float, str]] = []  # (sent s, ok, latency s, code)
        self.rss_samples: list[dict] = []  # {"t": s, name: RSS MiB, ...} every RSS_EVERY_S
        self.rss_warm: dict = {}  # (pid, RSS MiB) by process at the end of the warm-up
        self.rss_warm_s: float | None = None
        self.t0 = 0.0
        self._background: list[asyncio.Task] = []

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.t0

    # -------------------------------------------------------------- the run
    async def run(self) -> None:
        """Send for ``--duration`` with the faults on their schedule, then wait for every request."""
        self.t0 = time.monotonic()
        async with load.clients(self.ends) as (client, channel):
            self.client, self.channel = client, channel
            watchers = [asyncio.ensure_future(self._sample_forever()), asyncio.ensure_future(self._probe_forever()),
                        asyncio.ensure_future(self._rss_forever())]
            fault_task = asyncio.ensure_future(self._faults())
            requests, next_at, i = [], 0.0, 0
            while next_at < self.args.duration:
                await asyncio.sleep(max(0.0, next_at - self.now()))
                requests.append(asyncio.ensure_future(self._one(i)))
                i += 1
                next_at += self.rng.expovariate(self.args.rate)
            await fault_task
            await asyncio.gather(*requests, *self._background)
            await asyncio.sleep(2.0)  # the last samples after the last answer
            for task in watchers:
                task.cancel()

    def _record(self, kind: str, max_tokens: int, prompt_index: int = -1) -> ChaosRecord:
        record = ChaosRecord(f"c{len(self.records):05d}", kind, round(self.now(), 3), max_tokens, prompt_index)
        self.records.append(record)
        return record

    async def _bounded(self, record: ChaosRecord, coro) -> None:
        try:
            await asyncio.wait_for(coro, self.ends.deadline_s)
        except asyncio.TimeoutError:
            record.outcome, record.code = "lost", "hung past its deadline"
        record.end_s = round(self.now(), 3)

    async def _one(self, i: int) -> None:
        rng, ends = self.rng, self.ends
        kind = rng.choices(list(load.MIX), weights=list(load.MIX.values()))[0]
        prompt = rng.randrange(len(ends.prompts))
        if kind in ("stream", "complete", "grpc"):
            record = self._record(kind, ends.max_tokens, prompt)
            coro = {"stream": lambda: load.run_stream(ends, self.client, record),
                    "complete": lambda: load.run_complete(ends, self.client, record),
                    "grpc": lambda: load.run_grpc(ends, self.channel, record)}[kind]()
        elif kind == "cancel":
            record = self._record(kind, ends.max_tokens, prompt)
            coro = load.run_cancelled(ends, self.client, record, cancel_after_s=rng.uniform(0.5, 4.0))
        elif kind == "n2":
            record = self._record(kind, 24, prompt)
            coro = load.run_n2(ends, self.client, record, seed=rng.randrange(1 << 30))
        elif kind == "structured":
            record = self._record(kind, 32, prompt)
            coro = load.run_structured(ends, self.client, record)
        else:  # deadline: more output than 2 s can give on these cores
            record = self._record(kind, 200, prompt)
            coro = load.run_grpc(ends, self.channel, record, timeout_s=2.0)
        await self._bounded(record, coro)

    # --------------------------------------------------------------- faults
    async def _faults(self) -> None:
        if self.faults:  # the RSS baseline: after the warm-up's load, before any fault
            await asyncio.sleep(max(0.0, self.faults[0].window_start_s - self.now()))
            self.rss_warm = await asyncio.to_thread(self.fleet.rss)
            self.rss_warm_s = round(self.now(), 1)
        for i, fault in enumerate(self.faults):
            await asyncio.sleep(max(0.0, fault.at_s - self.now()))
            await self._settle(fault, self.faults[:i])
            fault.injected_s = round(self.now(), 1)
            print(f"[{fault.injected_s:7.1f} s] fault {fault.kind}", flush=True)
            try:
                await self._inject(fault)
            except Exception as exc:  # noqa: BLE001 - the report says which fault could not be done
                fault.detail += f" injection failed: {type(exc).__name__}: {exc}"
            self._background.append(asyncio.ensure_future(self._whole_after(fault)))

    async def _settle(self, fault: Fault, before: list[Fault], latest: float = 0.5) -> None:
        """Wait until the effects of the faults ``before`` are over: the queue empty (the last
        three samples read depth 0) and the fleet whole again after each of them, at most until
        ``latest`` of ``fault``'s window has passed; so a fault's time to recover is its own, not
        the backlog of the one before (a KV squeeze's can outlast a short window). Sets
        ``fault.waited_s`` and ``fault.queue_at_fault`` (what it met, shown in the report)."""
        limit = fault.window_start_s + latest * (fault.window_end_s - fault.window_start_s)
        started = self.now()
        while self.now() < limit and not self._quiet(before):
            await asyncio.sleep(0.5)
        fault.waited_s = round(self.now() - started, 1)
        depths = [s.get("queue_depth") for s in self.samples[-1:]]
        fault.queue_at_fault = depths[0] if depths else None

    def _quiet(self, before: list[Fault]) -> bool:
        """The queue read empty in the last three samples, and the fleet was whole again after
        every earlier fault that breaks a process (see :meth:`_whole_after`)."""
        recent = [s.get("queue_depth") for s in self.samples[-3:]]
        empty = len(recent) == 3 and all(d == 0 for d in recent)
        whole = all(f.whole_after_s is not None or f.kind in ("readers", "kv-squeeze") or f.injected_s is None
                    for f in before)
        return empty and whole

    async def _inject(self, fault: Fault) -> None:
        fleet = self.fleet
        if fault.kind in ("worker-kill", "worker-stop"):
            fault.target, running = await self._busiest(WORKERS, "inflight_requests_running")
            fault.detail, fault.injected_s = f"{running:.0f} sequences running on it", round(self.now(), 1)
            if fault.kind == "worker-kill":
                signal_group(fleet.pid(fault.target), SIGNALS["kill"])
                return
            pid = fleet.pid(fault.target)
            signal_group(pid, SIGNALS["stop"])
            self._background.append(asyncio.ensure_future(self._cont_later(pid, fault)))
        elif fault.kind == "gateway-kill":
            # streams to break, whatever the load: two over REST, two over gRPC, nginx spreads them
            ends, streams = self.ends, []
            for kind in ("stream", "stream", "grpc", "grpc"):
                record = self._record(kind, ends.max_tokens, self.rng.randrange(len(ends.prompts)))
                run = load.run_stream(ends, self.client, record) if kind == "stream" else \
                    load.run_grpc(ends, self.channel, record)
                streams.append(asyncio.ensure_future(self._bounded(record, run)))
            self._background.extend(streams)
            fault.target, waiting = await self._busiest(GATEWAYS, "inflight_gateway_waiting_clients", least=2)
            fault.injected_s = round(self.now(), 1)
            signal_group(fleet.pid(fault.target), SIGNALS["kill"])
            fault.detail = f"{waiting:.0f} clients waiting on it"
        elif fault.kind == "redis-kill":
            port = await asyncio.to_thread(fleet.sentinels.kill_master)
            fault.target = f"redis :{port}"
            self._background.append(asyncio.ensure_future(self._failover(port, fault)))
        elif fault.kind == "readers":
            self._background.append(asyncio.ensure_future(self._readers(fault)))
        elif fault.kind == "kv-squeeze":
            self._background.append(asyncio.ensure_future(self._squeeze(fault)))

    async def _busiest(self, names: tuple[str, ...], gauge: str, wait_s: float = 15.0,
                       least: int = 1) -> tuple[str, float]:
        """The process of ``names`` whose ``gauge`` reads highest (ties: a seeded choice), and
        that reading: a fault where it hurts most. Waits up to ``wait_s`` for a reading of
        ``least`` or more (a gateway with clients waiting, a worker with a sequence running)."""
        urls = self.fleet.metrics_urls()
        deadline = time.monotonic() + wait_s
        while True:
            readings = [await self._gauge(urls[n], gauge) for n in names]
            readings = [r if r == r else -1.0 for r in readings]  # NaN: not answering
            top = max(readings)
            if top >= least or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        name = self.rng.choice([n for n, r in zip(names, readings) if r == top])
        return name, max(top, 0.0)

    async def _cont_later(self, pid: int, fault: Fault) -> None:
        await asyncio.sleep(fault.hold_s)
        signal_group(pid, SIGNALS["cont"])
        fault.detail += f"; SIGCONT after {fault.hold_s:.0f} s"

    async def _failover(self, port: int, fault: Fault) -> None:
        sentinels = self.fleet.sentinels
        try:
            took = await asyncio.to_thread(sentinels.wait_failover, port, 60.0)
            fault.detail = f"sentinels promoted the replica {took:.1f} s after the kill"
        except RuntimeError as exc:
            fault.detail = f"no failover: {exc}"
        await asyncio.to_thread(sentinels.restart_killed, port)

    async def _whole_after(self, fault: Fault) -> None:
        """Wait (up to the window's end + 300 s) until every process is ready and Redis replicated."""
        if fault.kind in ("readers", "kv-squeeze"):
            return
        await asyncio.sleep(max(fault.hold_s, 1.0))
        limit = fault.window_end_s + 300
        while self.now() < limit:
            if await asyncio.to_thread(self.fleet.whole):
                fault.whole_after_s = round(self.now() - fault.injected_s, 1)
                return
            await asyncio.sleep(0.5)

    async def _readers(self, fault: Fault) -> None:
        ends = self.ends
        slow = self._record("slow", ends.max_tokens, 0)
        stalled = self._record("stalled", min(1000, self._kv_tokens() // 2), 1)  # must fit one worker's KV cache
        give_up = max(120.0, self.args.duration - fault.at_s + 60)
        results = await asyncio.gather(
            self._bounded(slow, load.run_slow_reader(ends, slow)),
            asyncio.wait_for(load.run_stalled_reader(ends, stalled, self._idle_cancelled, give_up), give_up + 60),
            return_exceptions=True)
        stalled.end_s = round(self.now(), 3)
        cancel_s = results[1] if isinstance(results[1], float) else None
        fault.detail = (f"slow reader {slow.outcome} ({slow.completion_tokens} chunks); stalled reader "
                        + (f"cancelled by the gateway {cancel_s:.1f} s after its last read" if cancel_s is not None
                           else f"{stalled.outcome}: {stalled.code} {stalled.note}".strip()))

    async def _idle_cancelled(self, request_id: str) -> bool:
        """True once a gateway logged the cancel of ``request_id``'s unread stream
        (gateway/rest/delivery.py): its own idle timeout, or the connection nginx closed on the
        edge's ``send_timeout`` while the request still generated."""
        needles = (f"stream {request_id}: the client took no chunk", f"stream {request_id}: the client went away")
        run_dir = self.fleet.stack.settings.run_dir
        logs = [(run_dir / f"{name}.log").read_text(errors="replace") for name in GATEWAYS
                if (run_dir / f"{name}.log").exists()]
        return any(needle in text for needle in needles for text in logs)

    def _kv_tokens(self) -> int:
        """Tokens one worker's KV cache holds (its ``inflight_kv_blocks_total`` x 16)."""
        blocks = max([s.get("blocks_total") or 0 for s in self.samples[-5:]] or [0])
        return int(blocks * 16) if blocks else 1024

    async def _squeeze(self, fault: Fault, most: int = 8, every_s: float = 3.0) -> None:
        """Long prompts (32 % of one worker's KV cache each, 96 output tokens: three on one
        worker outgrow its cache while they decode) one every ``every_s`` until the workers
        preempt, ``most`` at most."""
        target = int(0.32 * self._kv_tokens())
        unit = len(self.ends.encode(SQUEEZE_UNIT))
        before, sent = self._preemptions(), []
        while len(sent) < most and self._preemptions() <= before:
            record = self._record("squeeze", 96)
            prompt = f"Note {record.rid}. " + SQUEEZE_UNIT * max(1, target // unit) + "Summarize."
            sent.append(asyncio.ensure_future(self._bounded(record, load.run_squeeze(
                self.ends, self.client, record, prompt))))
            await asyncio.sleep(every_s)
        preempted = self._preemptions() - before
        await asyncio.gather(*sent)
        fault.detail = (f"{len(sent)} prompts of ~{target} tokens ({self._kv_tokens()} KV tokens a worker); "
                        f"first preemption {'seen' if preempted > 0 else 'NOT seen'} while sending, "
                        f"{self._preemptions() - before:.0f} by the time they finished")

    def _preemptions(self) -> float:
        """Preemptions so far on both workers (the latest of the last 3 samples that read them)."""
        return max([s["preemptions"] for s in self.samples[-3:] if "preemptions" in s] or [0.0])

    # ------------------------------------------------------------- watchers
    async def _gauge(self, url: str, name: str) -> float:
        """One metric of one process now (NaN when it does not answer within 3 s)."""
        async with httpx.AsyncClient(timeout=3.0) as client:
            try:
                return sample_sum((await client.get(url)).text, name)
            except httpx.HTTPError:
                return float("nan")

    async def _sample_forever(self, every_s: float = 1.0) -> None:
        """Every second: the workers' generated tokens, running sequences, preemptions and KV
        blocks, the gateways' queue depth (NaN where a process does not answer)."""
        urls = self.fleet.metrics_urls()
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                t = round(self.now(), 2)
                texts = await asyncio.gather(*(client.get(u) for u in urls.values()), return_exceptions=True)
                got = {n: (r.text if isinstance(r, httpx.Response) else None) for n, r in zip(urls, texts)}
                sample = {"t": t}
                for w in WORKERS:
                    text = got[w]
                    sample[f"{w}_tokens"] = sample_sum(text, "inflight_generation_tokens_total") if text else None
                    sample[f"{w}_running"] = sample_sum(text, "inflight_requests_running") if text else None
                    if text:
                        sample["preemptions"] = sample.get("preemptions", 0.0) + sample_sum(
                            text, "inflight_preemptions_total")
                        sample["blocks_total"] = sample_sum(text, "inflight_kv_blocks_total")
                depths = [sample_sum(got[g], "inflight_queue_depth") for g in GATEWAYS if got[g]]
                sample["queue_depth"] = max(depths) if depths else None
                self.samples.append(sample)
                await asyncio.sleep(max(0.0, every_s - (self.now() - t)))

    async def _rss_forever(self, every_s: float = 15.0) -> None:
        """Every ``every_s``: the RSS of every process (MiB), for the JSON (growth over the run)."""
        while True:
            t = round(self.now(), 1)
            rss = await asyncio.to_thread(self.fleet.rss)
            self.rss_samples.append({"t": t, **{name: mib for name, (_, mib) in rss.items()}})
            await asyncio.sleep(every_s)

    async def _probe_forever(self, every_s: float = 1.0) -> None:
        """A one-token completion through nginx every second (not counted as load)."""
        async with httpx.AsyncClient(timeout=chaos_report.PROBE_TIMEOUT_S) as client:
            n = 0
            while True:
                n += 1
                self._background.append(asyncio.ensure_future(self._probe(client, n)))
                await asyncio.sleep(every_s)

    async def _probe(self, client: httpx.AsyncClient, n: int) -> None:
        sent = self.now()
        try:
            r = await client.post(f"{self.ends.rest}/v1/completions", headers={"Authorization": f"Bearer {self.ends.key}"},
                                  json={"model": self.ends.model, "prompt": f"ping {n}", "max_tokens": 1})
            ok, code = r.status_code == 200, str(r.status_code)
        except httpx.HTTPError as exc:
            ok, code = False, type(exc).__name__
        self.probes.append((round(sent, 2), ok, round(self.now() - sent, 2), code))


# ----------------------------------------------------------------- setup
def references(ends: Endpoints) -> dict:
    """The unbroken greedy text of every prompt, over REST (non-streaming) and gRPC, taken before
    any fault; a streamed REST answer of prompt 0 must equal the non-streamed one.

    Raises:
        RuntimeError: a reference request failed, or streaming and not disagree (the check
            would then be meaningless).
    """
    async def take() -> dict:
        async with load.clients(ends) as (client, channel):  # all at once: the workers are batch-invariant
            keys = [(transport, i) for i in range(len(ends.prompts)) for transport in ("rest", "grpc")]
            texts = await asyncio.gather(*(_reference_text(ends, client, channel, ChaosRecord(
                f"ref-{t}-{i}", "reference", 0.0, ends.max_tokens, i), t) for t, i in keys))
            refs = dict(zip(keys, texts))
            record = ChaosRecord("ref-stream-0", "reference", 0.0, ends.max_tokens, 0)
            ends.references = refs
            await load.run_stream(ends, client, record)
            if record.outcome != "completed" or record.extra_tokens or record.missing_tokens:
                raise RuntimeError(f"a streamed greedy answer differs from the non-streamed one: {record}")
        return refs
    return asyncio.run(take())


def warm_gateways(fleet: Fleet, ends: Endpoints) -> None:
    """One structured-outputs request straight to each gateway (not through nginx, which would
    pick one), before the RSS baseline: a gateway's first such request builds llguidance's
    view of the vocabulary, the token-bytes tables and the grammar-check threads once, about
    45 MiB (seen with tracemalloc and RSS in the chaos fleet, bench/RESULTS.md "Chaos soak"),
    which the smoke run counted as growth of whichever gateway got the first one.

    Raises:
        httpx.HTTPError: a gateway did not answer 200.
    """
    body = {"model": ends.model, "messages": [{"role": "user", "content": "Name a city in France as JSON."}],
            "max_tokens": 8, "temperature": 0, "response_format": {
                "type": "json_schema", "json_schema": {"name": "city", "schema": load.SCHEMA, "strict": True}}}
    for port in fleet.gateway_rest.values():
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=ends.deadline_s,
                   headers={"Authorization": f"Bearer {ends.key}"}).raise_for_status()


async def _reference_text(ends, client, channel, record, transport) -> str | None:
    if transport == "rest":
        raw = await client.chat.completions.create(
            model=ends.model, messages=[{"role": "user", "content": ends.prompts[record.prompt_index]}],
            max_tokens=record.max_tokens, temperature=0, extra_body={"ignore_eos": True})
        return raw.choices[0].message.content
    from protos import inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceStub(channel)
    text = []
    async for message in stub.Generate(load._grpc_request(ends, record), timeout=ends.deadline_s,
                                       metadata=(("authorization", f"Bearer {ends.key}"),)):
        text.append(message.text)
    return "".join(text)


def main(argv: list[str] | None = None) -> int:
    """Run the chaos soak; print the report; write CSV, JSON and PNG under ``--out``.
    Exit status 1 when a request was lost or a token extra or missing."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    faults = schedule(args.duration, args.seed, args.hold_s, args.faults)
    if args.rate <= 0:
        raise SystemExit("need --rate > 0")
    from common.model_files import resolve_model_path
    from common.tokenizer import load_tokenizer

    options = WorkerOptions.from_args(args).replace(deterministic=True)
    worker_args = tuple(options.to_argv(("dtype", "kv_cache_mib", "max_batch_size", "threads", "deterministic")))
    gateway_args = ("--stream-idle-timeout", f"{args.stream_idle_timeout:g}")
    os.environ["INFLIGHT_GATEWAY_REQUEST_TIMEOUT_S"] = f"{args.request_timeout:g}"  # the gateways inherit it
    print("starting the fleet (2 workers, 2 gateways, nginx, Redis + replica + 3 sentinels) …", flush=True)
    fleet = start_fleet(options, worker_args, gateway_args,
                        client_send_timeout_s=max(1, round(args.stream_idle_timeout)))
    try:
        ends_urls = fleet.stack.endpoints()
        key = fleet.stack.create_key(tenant="chaos", name="bench chaos")
        model = httpx.get(f"{ends_urls['rest']}/v1/models", headers={"Authorization": f"Bearer {key}"},
                          timeout=10).json()["data"][0]["id"]
        tokenizer = load_tokenizer(resolve_model_path(args.model))
        ends = Endpoints(ends_urls["rest"], ends_urls["grpc"], key, model, PROMPTS, args.max_tokens,
                         encode=tokenizer.encode, deadline_s=args.request_timeout + 60)
        ends.references = references(ends)
        warm_gateways(fleet, ends)
        print(f"fleet up (logs in {fleet.stack.settings.run_dir}); references taken; "
              f"{len(faults)} faults over {args.duration:.0f} s …", flush=True)
        chaos = Chaos(args, fleet, ends, faults)
        rss_start = fleet.rss()
        asyncio.run(chaos.run())
        rss_end = fleet.rss()
        restarts = [(round(t - chaos.t0, 1), name) for t, name in fleet.supervised]
        run_dir = str(fleet.stack.settings.run_dir)
    finally:
        fleet.stop()
    chaos_report.recovery(faults, chaos.probes)
    chaos_report.open_requests(faults, chaos.records)
    ctx = report.context("")
    summary = chaos_report.summarize(
        chaos.records, faults, rss_start=rss_start, rss_end=rss_end, restarts=restarts,
        rss_warm=chaos.rss_warm, rss_warm_s=chaos.rss_warm_s, rss_samples=chaos.rss_samples,
        context={"machine": ctx.cpu, "cores": ctx.cores, "commit": ctx.commit, "started_utc": ctx.started_utc,
                 "command": "inflight bench chaos " + shlex.join(argv), "logs": run_dir})
    text = chaos_report.table(summary)
    print(text)
    stem = time.strftime("%Y%m%d-%H%M%S") + "-chaos" + (f"-{args.tag}" if args.tag else "")
    for path in chaos_report.write(summary, chaos.records, chaos.samples, chaos.probes, text, args.out, stem):
        print(f"wrote {path}")
    t = summary.total
    return 1 if t["lost"] or t["extra_tokens"] or t["missing_tokens"] else 0


if __name__ == "__main__":
    sys.exit(main())
