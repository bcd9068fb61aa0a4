"""bench/structured_outputs.py runs and writes its stamped CSV (the library part, few schemas)."""

from __future__ import annotations

import csv

from bench import structured_outputs


def test_backend_part_compiles_and_fills_along_valid_paths(tmp_path):
    args = ["--parts", "backend", "--backends", "llguidance", "--schemas", "4", "--batch", "4", "--out", str(tmp_path)]
    assert structured_outputs.main(args) == 0
    with next(tmp_path.glob("*-structured-outputs.csv")).open() as f:
        rows = [r for r in csv.DictReader(f) if r["backend"] == "llguidance"]
    compiles = [r for r in rows if r["metric"] == "compile_first_mask_ms"]
    assert len(compiles) == 4 and all(float(r["value"]) > 0 for r in compiles)
    metric = {r["metric"]: r["value"] for r in rows if r["schema"] in ("batch", "setup")}
    assert metric["rejected_tokens"] == "0" and metric["fill_batch_rows"] == "4"
    assert float(metric["fill_ms_per_step_median"]) > 0
