"""PNG charts of a run (matplotlib, Agg backend, no display needed).

Top: output tokens/s over time per (system, mode). Middle: running sequences
over time: request-level batching draws a saw-tooth (a batch drains, then the
next starts), iteration-level (continuous) batching a flat line near the
maximum (Orca, Yu et al. OSDI'22). Bottom: latency against throughput
(p50 and p99 end-to-end latency, seconds, against output tokens/s).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from bench.metrics import RunResult, token_rate_series  # noqa: E402
from bench.report import Row  # noqa: E402


def _label(system: str, mode: str) -> str:
    return f"{system} ({mode})"


def plot_run(results: list[RunResult], rows: list[Row], path: Path, title: str, bins: int = 40) -> None:
    """Write the three charts of a run to ``path`` (PNG); token rates in ``bins`` bins over the longest run."""
    end = max((r.end_s or 0.0 for res in results for r in res.records), default=1.0)
    bin_s = max(end / bins, 0.01)
    fig, (ax_rate, ax_occ, ax_lat) = plt.subplots(3, 1, figsize=(10, 11))
    for r in results:
        label = _label(r.system, r.mode)
        t, rate = token_rate_series(r.records, bin_s)
        ax_rate.plot(t, rate, label=label)
        times, running = zip(*r.occupancy) if r.occupancy else ((), ())
        ax_occ.step(times, running, where="post", label=label)
    ax_rate.set(xlabel="time (s)", ylabel=f"output tokens/s ({bin_s:g} s bins)", title=title)
    ax_occ.set(xlabel="time (s)", ylabel="running sequences")
    for row in rows:
        s = row.summary
        ax_lat.errorbar([s.output_tok_s], [s.e2e.p50], yerr=[[0], [max(0.0, s.e2e.p99 - s.e2e.p50)]], fmt="o",
                        capsize=4, label=_label(row.system, row.mode))
    ax_lat.set(xlabel="output tokens/s", ylabel="E2E latency p50 (dot) to p99 (bar), s")
    for ax in (ax_rate, ax_occ, ax_lat):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
