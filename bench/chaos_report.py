"""The chaos soak's report (``bench/chaos.py``): outcomes per fault window and in total, the
time to recover per fault, RSS of every process at start and end, and the files: a CSV of the
windows, a CSV of the requests, the JSON of everything, the printed text, one PNG timeline.

A request belongs to the window it was *sent* in (the warm-up before the first fault, then
each fault's window). Outcomes are :mod:`bench.chaos_load`'s. ``extra tokens`` are tokens of a
checked greedy answer that are not the reference's (a token delivered twice shows here);
``missing tokens`` are the reference's tokens the answer lacks.

RSS: of every process at the start of the load, at the end of the warm-up (the first fault's
window; the baseline of the target "within 10 % of its start after warm-up", since a
process's first minutes of load fill its caches to their bounds and its allocator's heap to
the load's high-water mark: bench/RESULTS.md "Chaos soak") and at the end; every 15 s in the
JSON. A process restarted after a fault is compared with its predecessor's baseline (marked).

Time to recover (``served after``): from the fault to the answer of the first probe (a
one-token completion through nginx, one a second, ``PROBE_TIMEOUT_S`` at most) that succeeded
after the last one that failed among those sent in the fault's window; 0 when none failed.
``worst probe``: the slowest probe answer in the window (a probe that timed out counts its
timeout), how long new requests waited meanwhile.
``whole after``: until every worker and gateway answered ``/ready`` and the Redis master had
an online replica again. ``requests open at fault``: load requests sent before the fault and still open when it was
done, and when the last of them ended (after a worker kill: its requests, continued on the
other worker, are among them). ``waited for quiet`` / ``queue at fault``: how long the fault waited
for the previous fault's effects to end (an empty queue, a whole fleet; at most until the middle
of its window) and the queue depth it met: a fault done on a non-empty queue measures that
backlog too.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.chaos_faults import Fault
from bench.chaos_load import ChaosRecord

OUTCOMES = ("completed", "cancelled", "ended", "failed", "lost")
PROBE_TIMEOUT_S = 20.0


def recovery(faults: list[Fault], probes: list[tuple[float, bool, float, str]]) -> None:
    """Fill each fault's ``served_after_s`` and ``worst_probe_s`` from the probes (see the
    module docstring)."""
    ordered = sorted(probes)
    for fault in faults:
        if fault.injected_s is None:
            continue
        mine = [p for p in ordered if fault.injected_s <= p[0] < fault.window_end_s]
        fault.worst_probe_s = max((p[2] for p in mine), default=None)
        failed = [p for p in mine if not p[1]]
        if not failed:
            fault.served_after_s = 0.0 if mine else None
            continue
        good = [p for p in ordered if p[0] > failed[-1][0] and p[1]]
        fault.served_after_s = round(good[0][0] + good[0][2] - fault.injected_s, 1) if good else None


def open_requests(faults: list[Fault], records: list[ChaosRecord]) -> None:
    """Fill each fault's ``open_at_fault`` (load requests sent before it and not ended when it
    was done) and ``open_ended_after_s`` (when the last of them ended, from the fault): for a
    worker kill, how long the requests it ran (requeued as continuations) took at most,
    which the probes, new requests, do not show."""
    for fault in faults:
        if fault.injected_s is None:
            continue
        t = fault.injected_s
        open_ = [r for r in records if r.sent_s < t < r.end_s and r.kind not in ("stalled", "slow")]
        fault.open_at_fault = len(open_)
        fault.open_ended_after_s = round(max(r.end_s for r in open_) - t, 1) if open_ else None


@dataclass
class ChaosSummary:
    """Everything the report prints and writes."""

    context: dict
    faults: list
    windows: list = field(default_factory=list)   # one dict per window
    total: dict = field(default_factory=dict)
    failed_by_code: dict = field(default_factory=dict)
    lost: list = field(default_factory=list)      # the lost requests, whole
    rss_start: dict = field(default_factory=dict)
    rss_end: dict = field(default_factory=dict)
    rss_warm: dict = field(default_factory=dict)    # after the warm-up: the baseline of the RSS target
    rss_warm_s: float | None = None
    rss_samples: list = field(default_factory=list)
    restarts: list = field(default_factory=list)


def _count(records: list[ChaosRecord]) -> dict:
    row = {"sent": len(records), **{o: sum(r.outcome == o for r in records) for o in OUTCOMES}}
    row["checked"] = sum(r.checked for r in records)
    row["resumed"] = sum(r.resumes > 0 for r in records)
    row["extra_tokens"] = sum(r.extra_tokens for r in records)
    row["missing_tokens"] = sum(r.missing_tokens for r in records)
    return row


def summarize(records: list[ChaosRecord], faults: list[Fault], **fields_) -> ChaosSummary:
    """Count outcomes per window and in total."""
    summary = ChaosSummary(faults=[asdict(f) for f in faults], **fields_)
    edges = [("warm-up", 0.0, faults[0].window_start_s if faults else math.inf)]
    edges += [(f"{f.kind} @{f.injected_s if f.injected_s is not None else f.at_s:.0f}s", f.window_start_s,
               f.window_end_s if i + 1 < len(faults) else math.inf) for i, f in enumerate(faults)]
    for name, start, end in edges:
        summary.windows.append({"window": name, **_count([r for r in records if start <= r.sent_s < end])})
    summary.total = {"window": "total", **_count(records)}
    summary.failed_by_code = dict(Counter(r.code for r in records if r.outcome == "failed").most_common())
    summary.lost = [asdict(r) for r in records if r.outcome == "lost" or r.extra_tokens or r.missing_tokens]
    return summary


def _fmt(value, unit: str = "") -> str:
    return "–" if value is None else f"{value:g}{unit}"


def table(summary: ChaosSummary) -> str:
    """The Markdown report."""
    ctx = summary.context
    cols = ["window", "sent", "completed", "cancelled", "ended", "failed", "lost", "checked", "resumed",
            "extra_tokens", "missing_tokens"]
    heads = ["window", "sent", "completed", "cancelled by client", "ended by gateway (unread)",
             "failed (clear error)", "lost", "greedy checked", "resumed", "tokens twice/wrong", "tokens missing"]
    lines = [f"machine: {ctx.get('machine')} ({ctx.get('cores')} cores) · commit {ctx.get('commit')} · "
             f"{ctx.get('started_utc')}", f"command: {ctx.get('command')}", "",
             "| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for row in [*summary.windows, summary.total]:
        lines.append("| " + " | ".join(str(row[c]) for c in cols) + " |")
    lines.append("")
    if summary.failed_by_code:
        lines += ["| failed: code | count |", "|---|---:|"]
        lines += [f"| {code} | {n} |" for code, n in summary.failed_by_code.items()] + [""]
    lines += ["| fault | at (s) | waited for quiet (s) | queue at fault | target | served again after (s) | "
              "bound (s) | within | worst probe (s) | requests open at fault: last ended after (s) | "
              "whole again after (s) | what happened |",
              "|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---|"]
    for f in summary.faults:
        within = ("–" if f["bound_s"] is None or f["served_after_s"] is None
                  else "yes" if f["served_after_s"] <= f["bound_s"] else "NO")
        lines.append(f"| {f['kind']} | {_fmt(f['injected_s'])} | {_fmt(f.get('waited_s'))} | "
                     f"{_fmt(f.get('queue_at_fault'))} | {f['target'] or '–'} | {_fmt(f['served_after_s'])} | "
                     f"{_fmt(f['bound_s'])} | {within} | {_fmt(f['worst_probe_s'])} | "
                     f"{_fmt(f.get('open_at_fault'))}: {_fmt(f.get('open_ended_after_s'))} | {_fmt(f['whole_after_s'])} | "
                     f"{f['detail'].strip() or '–'} |")
    lines.append("")
    if summary.restarts:
        lines += ["restarted by the supervisor: " + ", ".join(f"{n} at {t:g} s" for t, n in summary.restarts), ""]
    warm_at = f" (at {summary.rss_warm_s:g} s)" if summary.rss_warm_s is not None else ""
    lines += [f"| process | pid at start | RSS at start (MiB) | RSS after warm-up{warm_at} (MiB) | pid at end | "
              "RSS at end (MiB) | end/after warm-up |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, (pid, start) in summary.rss_start.items():
        warm_pid, warm = summary.rss_warm.get(name, (None, 0.0))
        end_pid, end = summary.rss_end.get(name, (None, 0.0))
        ratio = f"{end / warm:.2f}" if warm and end else "–"
        if warm and end and end_pid != warm_pid:
            ratio += " (another process)"  # restarted after a fault: its predecessor's baseline
        lines.append(f"| {name} | {pid or '–'} | {start:.0f} | {_fmt(round(warm) if warm else None)} | "
                     f"{end_pid or '–'} | {end:.0f} | {ratio} |")
    if summary.lost:
        lines += ["", "| lost or wrong: request | kind | sent (s) | outcome | code | resumes | tokens twice/wrong | "
                  "missing | note |", "|---|---|---:|---|---|---:|---:|---:|---|"]
        for r in summary.lost:
            lines.append(f"| {r['rid']} ({r['server_id'] or '–'}) | {r['kind']} | {r['sent_s']:.1f} | {r['outcome']} | "
                         f"{r['code']} | {r['resumes']} | {r['extra_tokens']} | {r['missing_tokens']} | {r['note']} |")
    return "\n".join(lines)


def write(summary: ChaosSummary, records: list[ChaosRecord], samples: list[dict], probes: list, text: str,
          out_dir: Path, stem: str) -> list[Path]:
    """Write ``{stem}.csv`` (the windows and the total), ``{stem}-requests.csv``, ``{stem}.json``,
    ``{stem}.txt`` (the printed report) and ``{stem}.png`` (the timeline) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}{suffix}" for suffix in (".csv", "-requests.csv", ".json", ".txt", ".png")]
    rows = [*summary.windows, summary.total]
    with paths[0].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ChaosRecord.__dataclass_fields__))
        writer.writeheader()
        writer.writerows(asdict(r) for r in records)
    paths[2].write_text(json.dumps({**asdict(summary), "samples": samples, "probes": probes}, indent=1,
                                   default=str) + "\n")
    paths[3].write_text(text + "\n")
    plot_timeline(samples, probes, summary.faults, paths[4], summary.context.get("command", ""))
    return paths


def token_rates(samples: list[dict], workers: tuple[str, ...] = ("worker", "worker-2")) -> list[tuple[float, float]]:
    """(t, output tokens/s over both workers) between consecutive samples; a counter that went
    down (a restarted worker) or a missing sample counts as 0 for that worker."""
    out = []
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0:
            continue
        rate = 0.0
        for w in workers:
            x, y = a.get(f"{w}_tokens"), b.get(f"{w}_tokens")
            if x is not None and y is not None and y >= x:
                rate += (y - x) / dt
        out.append((b["t"], rate))
    return out


def plot_timeline(samples: list[dict], probes: list, faults: list[dict], path: Path, title: str) -> None:
    """tok/s, queue depth and running sequences per worker over time, each fault shaded and
    named, failed probes marked (red) on the top chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    rates = token_rates(samples)
    axes[0].plot([t for t, _ in rates], [r for _, r in rates], lw=0.8, label="output tok/s (both workers)")
    failed = [p[0] for p in probes if not p[1]]
    if failed:
        axes[0].plot(failed, [0] * len(failed), "rx", ms=4, label="probe failed")
    axes[1].plot([s["t"] for s in samples], [s.get("queue_depth") for s in samples], lw=0.8, label="queue depth")
    for w in ("worker", "worker-2"):
        axes[2].plot([s["t"] for s in samples], [s.get(f"{w}_running") for s in samples], lw=0.8, label=w)
    for f in faults:
        if f["injected_s"] is None:
            continue
        width = max(f["hold_s"], 2.0)
        for ax in axes:
            ax.axvspan(f["injected_s"], f["injected_s"] + width, color="tab:red", alpha=0.15)
        axes[0].annotate(f["kind"], (f["injected_s"], 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                         rotation=90, va="top")
    axes[0].set(ylabel="tokens/s", title=title[:120])
    axes[1].set(ylabel="queue depth (entries)")
    axes[2].set(ylabel="running sequences", xlabel="time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
