"""Outcomes of a soak run (``bench/soak.py``): one record per request, the table, CSV and JSON.

Every request ends in exactly one outcome:

* ``completed``: the stream ended with a ``finish_reason`` and no error;
* ``cancelled``: the client cancelled it on purpose (closed the stream) before it ended;
* ``failed``: it ended with a clear error: an HTTP status with an OpenAI error body, an
  SSE ``{"error": …}`` event, or a gRPC status; ``code`` says which;
* ``lost``: anything else: the stream ended without ``finish_reason`` and without an
  error, the connection broke without one (a transport exception), or it was still
  open at its deadline (hung). A healthy stack loses nothing.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from stack.clients import StreamResult

OUTCOMES = ("completed", "cancelled", "failed", "lost")


@dataclass
class SoakRecord:
    """One request of the soak. Times in seconds from the start of the run."""

    request_id: str
    transport: str
    sent_s: float
    max_tokens: int
    cancel_after_s: float | None
    outcome: str = "lost"
    code: str = ""              # error code (failed) or why it counts as lost
    finish_reason: str = ""
    completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    error: str = ""


def error_code(error: str) -> str:
    """A short code for a client-side error string of ``stack.clients``:
    ``http 503 service_unavailable`` (from the OpenAI body), ``stream unavailable``,
    ``grpc UNAVAILABLE``; the text itself when it has none of those shapes."""
    if error.startswith("HTTP "):
        status, _, body = error[5:].partition(": ")
        try:
            err = json.loads(body)["error"]
            return f"http {status} {err.get('code') or err.get('type')}"
        except (ValueError, KeyError, TypeError):
            return f"http {status}"
    if error.startswith("stream error "):
        return "stream " + error[len("stream error "):].split(":", 1)[0]
    head = error.split(":", 1)[0]
    if head.isupper() and " " not in head:
        return f"grpc {head}"
    return error[:60]


def classify(record: SoakRecord, result: StreamResult | None, problem: str = "") -> SoakRecord:
    """Fill ``record``'s outcome from a finished stream, or from ``problem`` ("cancelled",
    "hung past its deadline", or a transport exception's text) when there is no result."""
    if problem == "cancelled":
        record.outcome = "cancelled"
        return record
    if result is None:
        record.outcome, record.code, record.error = "lost", problem or "no result", problem
        return record
    record.finish_reason = result.finish_reason or ""
    record.completion_tokens, record.ttft_s, record.e2e_s = result.completion_tokens, result.ttft_s, result.e2e_s
    if result.error:
        record.outcome, record.code, record.error = "failed", error_code(result.error), result.error[:300]
    elif result.finish_reason:
        record.outcome = "completed"
    else:
        record.outcome, record.code = "lost", "ended without finish_reason or error"
    return record


@dataclass
class SoakSummary:
    """Counts of a run plus what the report prints around them."""

    settings: dict
    context: dict
    restart: dict
    rss_mib: dict                       # process -> {"start": MiB, "end": MiB, ...}
    rss_samples: list = field(default_factory=list)  # (t_s, worker MiB, gateway MiB)
    counts: dict = field(default_factory=dict)
    failed_by_code: dict = field(default_factory=dict)
    lost_by_reason: dict = field(default_factory=dict)
    token_mismatches: int = 0           # completed with a token count other than max_tokens


def summarize(records: list[SoakRecord], **fields_) -> SoakSummary:
    """Count outcomes, errors by code and lost requests by reason."""
    summary = SoakSummary(**fields_)
    summary.counts = {"sent": len(records), **{o: sum(r.outcome == o for r in records) for o in OUTCOMES}}
    summary.failed_by_code = dict(Counter(r.code for r in records if r.outcome == "failed").most_common())
    summary.lost_by_reason = dict(Counter(r.code for r in records if r.outcome == "lost").most_common())
    summary.token_mismatches = sum(r.outcome == "completed" and r.completion_tokens != r.max_tokens
                                   for r in records)
    return summary


def table(summary: SoakSummary) -> str:
    """The Markdown report: context, outcome counts, errors by code, restart and RSS."""
    c, ctx = summary.counts, summary.context
    lines = [f"machine: {ctx.get('machine')} ({ctx.get('cores')} cores) · commit {ctx.get('commit')} · "
             f"{ctx.get('started_utc')}",
             f"command: {ctx.get('command')}", f"settings: {summary.settings}", "",
             "| sent | completed | cancelled by client | failed (clear error) | lost | token-count mismatches |",
             "|---:|---:|---:|---:|---:|---:|",
             f"| {c['sent']} | {c['completed']} | {c['cancelled']} | {c['failed']} | {c['lost']} | "
             f"{summary.token_mismatches} |", ""]
    if summary.failed_by_code:
        lines += ["| failed: code | count |", "|---|---:|"]
        lines += [f"| {code} | {n} |" for code, n in summary.failed_by_code.items()] + [""]
    if summary.lost_by_reason:
        lines += ["| lost: reason | count |", "|---|---:|"]
        lines += [f"| {why} | {n} |" for why, n in summary.lost_by_reason.items()] + [""]
    r = summary.restart
    if r:
        lines += [f"worker restart ({r.get('signal')}) at t = {r.get('at_s', 0):.0f} s: old worker exited in "
                  f"{r.get('exit_s', 0):.1f} s (code {r.get('exit_code')}), new one ready "
                  f"{r.get('ready_s', 0):.1f} s after the signal", ""]
    lines += ["| process | RSS at start (MiB) | old worker before restart | new worker after restart "
              "| RSS at end (MiB) |", "|---|---:|---:|---:|---:|"]
    for name, rss in summary.rss_mib.items():
        cells = [f"{rss[k]:.0f}" if rss.get(k) else "–" for k in ("start", "before_restart", "after_restart", "end")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(summary: SoakSummary, records: list[SoakRecord], out_dir: Path, stem: str) -> tuple[Path, Path]:
    """Write ``{stem}.csv`` (one row per request) and ``{stem}.json`` (the summary) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.json"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(records[0]) if records else SoakRecord.__annotations__))
        writer.writeheader()
        for r in records:
            writer.writerow(asdict(r))
    json_path.write_text(json.dumps(asdict(summary), indent=2, default=str) + "\n")
    return csv_path, json_path
