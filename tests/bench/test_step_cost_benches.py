"""bench/spec_decode.py, bench/contention.py and bench/fixed_cost.py run on the tiny
model and write their stamped CSVs with the rows and columns RESULTS.md quotes."""

from __future__ import annotations

import csv

import torch

from bench import contention, fixed_cost, spec_decode


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
