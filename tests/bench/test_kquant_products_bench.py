"""bench/kquant_products.py times both K-quant paths on a small shape and writes the CSV rows
RESULTS.md quotes (where the build has a dense K-quant path)."""

from __future__ import annotations

import csv

import pytest

import inflight_kernels
from bench import kquant_products


def test_kquant_products_bench_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(kquant_products, "SHAPES", (("Q4_K", 64, 512, "tiny"), ("Q6_K", 48, 256, "tiny")))
    args = ["--threads", "1", "--rows", "4", "9", "--rounds", "1", "--out", str(tmp_path)]
    if inflight_kernels.cpu_kquant_tiles() is None:
        assert kquant_products.main(args) == 1
        pytest.skip("no dense K-quant path in this build")
    assert kquant_products.main(args) == 0
    with next(tmp_path.glob("*-kquant-products.csv")).open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["weight"], r["rows"]) for r in rows] == [
        ("Q4_K 64x512 (tiny)", "4"), ("Q4_K 64x512 (tiny)", "9"), ("Q6_K 48x256 (tiny)", "4"), ("Q6_K 48x256 (tiny)", "9")]
    assert all(float(r["int16_gmacs"]) > 0 and float(r["dense_gmacs"]) > 0 for r in rows)
    assert {r["tiles"] for r in rows} == {inflight_kernels.cpu_kquant_tiles()}
