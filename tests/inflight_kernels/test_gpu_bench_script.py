"""The one-shot GPU script (bench/gpu_kernels.py) parses, builds its grids and runs
its check harness on the CPU, with the reference standing in for cuda_ops."""

from __future__ import annotations

import math

import pytest
import torch

from bench import gpu_kernels as g
from inflight_kernels import reference
from inflight_kernels.cuda import ops as cuda_ops


def test_args_and_grids_cover_the_brief():
    args = g.parse_args(["--out", "x.csv"])
    cases = g.correctness_cases(args.dtypes, seed=0)
    assert {c.gqa for c in cases} == {1, 4, 8} and {c.block_size for c in cases} == {8, 16, 32}
    assert {64, 128} <= {c.head_size for c in cases} and {c.dtype for c in cases} == set(g.TOLERANCE)
    assert min(c.max_ctx for c in cases) == 1 and max(c.max_ctx for c in cases) == 32768
    assert {1, 256} <= {c.batch for c in cases} and any(c.ragged for c in cases)
    assert {True, False} <= {c.force_split for c in cases}
    assert all(c.batch * c.max_ctx <= g.MAX_CASE_TOKENS for c in cases)
    with pytest.raises(SystemExit):
        g.parse_args(["--out", "x.csv", "--dtypes", "int8"])


@pytest.fixture()
def cpu_harness(monkeypatch):
    monkeypatch.setattr(g, "DEVICE", "cpu")
    monkeypatch.setattr(g, "MAX_CASE_TOKENS", 4096)
    monkeypatch.setattr(cuda_ops, "paged_attention", reference.paged_attention)
    monkeypatch.setattr(cuda_ops, "reshape_and_cache", reference.reshape_and_cache)


def test_checks_pass_with_reference_and_csv_written(cpu_harness, tmp_path, capsys):
    args = g.parse_args(["--out", str(tmp_path / "r.csv"), "--quick", "--dtypes", "float32,bfloat16"])
    rows, skipped = g.run_checks(args, torch.Generator().manual_seed(0))
    assert skipped == 0 and rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    rows.append({"kind": "time", "op": "reshape_and_cache", "dtype": "float16", "head_size": 128,
                 "block_size": 16, "num_tokens": 64, "kernel_ms": 0.01, "kernel_gbs": 100.0, "copy_frac": 0.1})
    g.print_table(rows, 1000.0)
    g.write_csv(args.out, rows, {"device": "cpu"})
    assert args.out.read_text().startswith("device,")
    assert "passed" in capsys.readouterr().out


def test_unwritten_output_fails(cpu_harness, monkeypatch):
    monkeypatch.setattr(cuda_ops, "paged_attention", lambda *a, out=None: out)  # leaves the NaN poison
    row = g.check_attention(g.AttnCase("float32", 64, 16, 2, 40, 4), torch.Generator().manual_seed(0))
    assert not row["ok"] and math.isinf(row["rel_err"])
