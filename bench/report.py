"""The printed table and the CSV rows of a run, stamped with machine, commit and settings."""

from __future__ import annotations

import csv
import math
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.ceiling import Hardware, ModelCost, ceiling
from bench.cpu_share import CpuShare
from bench.metrics import SLO, RunResult, Summary, summarize


@dataclass(frozen=True)
class Context:
    """Where and how the run happened: cpu model, cores, commit, settings (the command line), UTC start."""

    cpu: str
    cores: int
    commit: str
    settings: str
    started_utc: str


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def context(settings: str) -> Context:
    """The machine (lscpu model, usable cores), ``git rev-parse --short HEAD`` and the settings line."""
    return Context(_lscpu_model(), len(os.sched_getaffinity(0)), _commit(), settings,
                   time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


@dataclass(frozen=True)
class Row:
    """One (system, mode) line: its summary plus the ceiling at its mean batch (tokens/s) and fractions of it."""

    system: str
    mode: str
    dtype: str
    max_batch_size: int
    summary: Summary
    compute_ceiling_tok_s: float
    roofline_tok_s: float
    prefix_cache_hit_ratio: float | None = None
    cpu: CpuShare | None = None

    @property
    def frac_compute(self) -> float:
        """Output tokens/s over the compute ceiling (0..1)."""
        return self.summary.output_tok_s / self.compute_ceiling_tok_s

    @property
    def frac_roofline(self) -> float:
        """Output tokens/s over min(compute, memory) ceiling (0..1)."""
        return self.summary.output_tok_s / self.roofline_tok_s


def make_rows(results: list[RunResult], slo: SLO, hw: Hardware, cost: ModelCost) -> list[Row]:
    """Summaries and ceilings (memory bound at the run's mean running sequences)."""
    rows = []
    for r in results:
        s = summarize(r.records, slo, r.occupancy)
        c = ceiling(hw, cost, s.mean_running if math.isfinite(s.mean_running) else 1.0)
        rows.append(Row(r.system, r.mode, r.dtype, r.max_batch_size, s, c.compute_tok_s, c.tok_s,
                        r.prefix_cache_hit_ratio, r.cpu))
    return rows


_HEAD = ("system", "mode", "dtype", "batch", "ok/fail", "tok/s", "req/s", "TTFT p50/p90/p99 s",
         "ITL p50/p90/p99 ms", "E2E p50/p99 s", "goodput req/s", "mean run", "%compute", "%roofline", "PC hit %")


def _cells(row: Row) -> tuple[str, ...]:
    s = row.summary
    return (row.system, row.mode, row.dtype, str(row.max_batch_size), f"{s.completed}/{s.failed}",
            f"{s.output_tok_s:.1f}", f"{s.req_s:.2f}", f"{s.ttft.p50:.2f}/{s.ttft.p90:.2f}/{s.ttft.p99:.2f}",
            f"{s.itl.p50 * 1e3:.0f}/{s.itl.p90 * 1e3:.0f}/{s.itl.p99 * 1e3:.0f}", f"{s.e2e.p50:.1f}/{s.e2e.p99:.1f}",
            f"{s.goodput_req_s:.2f}", f"{s.mean_running:.1f}", f"{100 * row.frac_compute:.1f}",
            f"{100 * row.frac_roofline:.1f}",
            "-" if row.prefix_cache_hit_ratio is None else f"{100 * row.prefix_cache_hit_ratio:.1f}")


def prefix_cache_gains(rows: list[Row]) -> list[str]:
    """For each mode run both ways (``<mode>+pc`` and ``<mode>-nopc`` rows of
    one system): the hit ratio and the TTFT gain of the prefix cache."""
    lines = []
    by_key = {(r.system, r.mode): r for r in rows}
    for (system, mode), on in by_key.items():
        if not mode.endswith("+pc") or (system, mode[:-3] + "-nopc") not in by_key:
            continue
        off = by_key[(system, mode[:-3] + "-nopc")]
        a, b = on.summary.ttft, off.summary.ttft
        hit = on.prefix_cache_hit_ratio or 0.0
        lines.append(f"prefix cache ({system}, {mode[:-3]}): hit ratio {100 * hit:.1f}% · TTFT p50 {a.p50:.3f} s "
                     f"vs {b.p50:.3f} s without ({_gain(a.p50, b.p50)}), p90 {a.p90:.3f} vs {b.p90:.3f} s "
                     f"({_gain(a.p90, b.p90)}) · tok/s {on.summary.output_tok_s:.1f} vs {off.summary.output_tok_s:.1f}")
    return lines


def _gain(on: float, off: float) -> str:
    if not (on > 0 and math.isfinite(on) and math.isfinite(off)):
        return "n/a"
    return f"{100 * (on - off) / off:+.0f}% with the cache, speed-up {off / on:.2f}x"


def table(rows: list[Row], ctx: Context, hw: Hardware, cost: ModelCost, workload: str, slo: SLO) -> str:
    """A Markdown table with a header block (machine, commit, settings, ceiling)."""
    lines = [f"machine: {ctx.cpu}, {ctx.cores} cores · commit {ctx.commit} · {ctx.started_utc}",
             f"settings: {ctx.settings}", f"workload: {workload}",
             f"SLO: TTFT <= {slo.ttft_s} s, TPOT <= {slo.itl_s} s",
             f"ceiling: matmul {hw.matmul_flops / 1e9:.0f} GFLOP/s ({hw.dtype}, n={hw.matmul_n}), copy "
             f"{hw.bandwidth / 1e9:.1f} GB/s; model {cost.params / 1e6:.1f} M params, {cost.weight_bytes / 2**20:.0f} MiB"
             f" -> compute bound {rows[0].compute_ceiling_tok_s if rows else float('nan'):.0f} tok/s", "",
             "| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    extra = prefix_cache_gains(rows) + cpu_lines(rows)
    return "\n".join(lines + ([""] + extra if extra else []))


#: the process that does the serving work, per system (the bench process itself runs the engine target).
_SERVING_ROLE = {"inflight-engine": "client", "inflight-stack": "worker"}


def cpu_lines(rows: list[Row]) -> list[str]:
    """Per row with CPU figures: CPU seconds and cores per process role, and
    CPU milliseconds of the serving process (the worker of a stack the bench
    started, the bench process for the in-process engine) per output token."""
    lines = []
    for r in rows:
        if r.cpu is None or not r.cpu.by_role:
            continue
        server = r.cpu.by_role.get(_SERVING_ROLE.get(r.system, ""), 0.0)
        per_tok = f" · serving process {1e3 * server / r.summary.output_tokens:.1f} CPU ms per output token" \
            if server and r.summary.output_tokens else ""
        lines.append(f"cpu ({r.system}, {r.mode}): {r.cpu.describe()}{per_tok}")
    return lines


def _cpu_columns(rows: list[Row]) -> list[str]:
    return sorted({f"cpu_s_{role}" for r in rows if r.cpu for role in r.cpu.by_role})


def _cpu_cells(row: Row, columns: list[str]) -> dict:
    if not columns:
        return {}
    cells = dict.fromkeys([*columns, "cpu_wall_s", "cpu_cores", "cpu_idle_s"], "")
    if row.cpu:
        cpu = row.cpu
        cells.update({f"cpu_s_{role}": v for role, v in cpu.by_role.items()}, cpu_wall_s=cpu.wall_s,
                     cpu_cores=cpu.cores, cpu_idle_s="" if cpu.idle_s is None else cpu.idle_s)
    return cells


def write_csv(rows: list[Row], ctx: Context, hw: Hardware, path: Path, workload: str) -> None:
    """One CSV line per row with every metric (seconds, tokens/s) and the context columns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out, cpu_columns = [], _cpu_columns(rows)
    for r in rows:
        s = asdict(r.summary)
        flat = {k: v for k, v in s.items() if not isinstance(v, dict)}
        for name in ("ttft", "itl", "e2e"):
            flat.update({f"{name}_{q}_s": v for q, v in s[name].items()})
        out.append({"system": r.system, "mode": r.mode, "dtype": r.dtype, "max_batch_size": r.max_batch_size,
                    **flat, "compute_ceiling_tok_s": r.compute_ceiling_tok_s, "roofline_tok_s": r.roofline_tok_s,
                    "frac_compute": r.frac_compute, "frac_roofline": r.frac_roofline,
                    "prefix_cache_hit_ratio": "" if r.prefix_cache_hit_ratio is None else r.prefix_cache_hit_ratio,
                    "matmul_flops": hw.matmul_flops, "bandwidth_bytes_s": hw.bandwidth, "workload": workload,
                    **_cpu_cells(r, cpu_columns), **asdict(ctx)})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)


def write_stamped_csv(rows: list[dict], ctx: Context, out_dir: Path, name: str) -> Path:
    """Write ``rows`` (same keys each) to ``out_dir/<UTC time>-<name>.csv``, every row
    stamped with the machine, the commit and the command line; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], "cpu", "cores", "commit", "settings"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "cpu": ctx.cpu, "cores": ctx.cores, "commit": ctx.commit, "settings": ctx.settings})
    return path
