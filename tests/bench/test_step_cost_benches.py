"""bench/spec_decode.py, bench/contention.py and bench/fixed_cost.py run on the tiny
model and write their stamped CSVs with the rows and columns RESULTS.md quotes."""

from __future__ import annotations

import csv

import torch

import pytest

from bench import contention, fixed_cost, profile_step, spec_decode


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_spec_decode_bench_rows(tmp_path):
    args = ["--model", "tiny", "--max-tokens", "6", "--num-bench-prompts", "2", "--batch-sizes", "2",
            "--rounds", "1", "--out", str(tmp_path)]
    assert spec_decode.main(args) == 0
    rows = _rows(next(tmp_path.glob("*-spec-decode.csv")))
    assert [(r["workload"], r["spec"]) for r in rows] == [
        ("bench", "off"), ("bench", "on"), ("rewrite", "off"), ("rewrite", "on"), ("batch-2", "off"), ("batch-2", "on")]
    assert all(float(r["tok_s"]) > 0 for r in rows) and all(r["drafts"] == "0" for r in rows if r["spec"] == "off")


def test_contention_bench_starts_and_stops_its_competitor(tmp_path):
    args = ["--model", "tiny", "--requests", "2", "--batch", "2", "--max-tokens", "4", "--out", str(tmp_path)]
    assert contention.main(args) == 0
    rows = _rows(next(tmp_path.glob("*-contention.csv")))
    assert [r["case"] for r in rows] == ["alone", "busy, fixed threads", "busy, governor"]
    assert all(float(r["tok_s"]) > 0 for r in rows)


def test_fixed_cost_bench_without_the_real_model(tmp_path):
    assert fixed_cost.main(["--real", "off", "--batches", "1,2", "--repeats", "2", "--out", str(tmp_path)]) == 0
    rows = _rows(next(tmp_path.glob("*-fixed-cost.csv")))
    assert [r["batch"] for r in rows] == ["1", "2"] and all(float(r["tiny_engine_ms"]) > 0 for r in rows)
    for r in rows:  # the KV read is timed on its own and taken out of the engine step
        assert float(r["tiny_kv_read_ms"]) >= 0
        assert float(r["tiny_fixed_ms"]) == pytest.approx(float(r["tiny_engine_ms"]) - float(r["tiny_kv_read_ms"]), abs=2e-3)


def test_fixed_cost_bench_takes_the_block_size(tmp_path):
    args = ["--real", "off", "--batches", "2", "--repeats", "2", "--block-size", "32", "--out", str(tmp_path)]
    assert fixed_cost.main(args) == 0
    rows = _rows(next(tmp_path.glob("*-fixed-cost.csv")))
    assert [r["block_size"] for r in rows] == ["32"] and float(rows[0]["tiny_runner_ms"]) > 0


def test_profile_step_block_tables_in_order_and_scattered():
    assert profile_step.block_tables(2, 40, 16, 10, scattered=False) == [[0, 1, 2], [3, 4, 5]]
    scattered = profile_step.block_tables(3, 40, 16, 50, scattered=True)
    ids = [i for table in scattered for i in table]
    assert [len(t) for t in scattered] == [3, 3, 3] and len(set(ids)) == 9 and all(0 <= i < 50 for i in ids)
    assert ids != sorted(ids) and scattered == profile_step.block_tables(3, 40, 16, 50, scattered=True)
    with pytest.raises(ValueError, match="do not fit"):
        profile_step.block_tables(4, 40, 16, 11, scattered=True)


def test_profile_step_csv_rows_carry_the_block_layout():
    times = {c: 2.0 for c in profile_step.COLUMNS}
    result = {"dtype": "torch.bfloat16", "kv_cache_dtype": "torch.bfloat16", "quantization": "gguf",
              "block_size": 128, "num_blocks": 177, "scattered": True, "rows": {"32": times}}
    [row] = profile_step.csv_rows(result, "here")
    assert (row["batch"], row["block_size"], row["num_blocks"], row["scattered_blocks"]) == (32, 128, 177, True)
    assert row["forward_ms"] == 2.0 and row["tok_s"] == 32 * 1e3 / 4.0
    assert profile_step.default_block_size() == 16


def test_the_dtype_cell_names_bfloat16_activations_of_gguf():
    """The bench tables tell the gguf rows whose block products round activations to bfloat16
    from the float32 ones."""
    import inflight_kernels
    from bench.targets.engine import dtype_label
    from worker.model.model_runner import tiny_random_runner

    formats = {f"model.layers.{i}.{part}.weight": "q4_1" for i in range(2)
               for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    exact = tiny_random_runner(quantization="gguf", formats=formats, kv_cache_dtype=torch.float16)
    assert dtype_label(exact) == "float32, kv float16, gguf"
    if inflight_kernels.cpu_dequant_bf16():
        rounded = tiny_random_runner(quantization="gguf", formats=formats, kv_cache_dtype=torch.float16,
                                     bf16_activations=True)
        assert dtype_label(rounded) == "float32, kv float16, gguf bf16-act"
    if inflight_kernels.cpu_dequant_bf16() and inflight_kernels.cpu_bf16_gemm():
        dense = tiny_random_runner(quantization="gguf", formats=formats, kv_cache_dtype=torch.float16,
                                   bf16_activations=True, dense_min_rows=16)
        assert dtype_label(dense) == "float32, kv float16, gguf bf16-act dense>=16"


def test_attention_memory_layouts():
    from bench import attention_memory as am

    assert am.block_table("in order", 2, 3, 10).tolist() == [[0, 1, 2], [3, 4, 5]]
    cached = am.block_table("in cache", 3, 2, 10).tolist()
    assert cached[0] == cached[1] == cached[2] and len(set(cached[0])) == 2
    scattered = am.block_table("scattered", 3, 2, 10).flatten().tolist()
    assert len(set(scattered)) == 6 and all(0 <= i < 10 for i in scattered)
    with pytest.raises(ValueError, match="do not fit"):
        am.block_table("scattered", 3, 4, 10)
    with pytest.raises(ValueError, match="unknown layout"):
        am.block_table("sideways", 1, 1, 10)
    assert am.pool_blocks(16) == (512 << 20) // (30 * 2 * 3 * 64 * 2 * 16)
