"""bench/sampler.py and bench/parallel_sampling.py run and write their stamped CSVs."""

from __future__ import annotations

import csv

from bench import parallel_sampling, sampler


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_sampler_bench_writes_a_row_per_case(tmp_path):
    assert sampler.main(["--batches", "2", "--repeats", "1", "--history", "8", "--out", str(tmp_path)]) == 0
    rows = _rows(next(tmp_path.glob("*-sampler.csv")))
    assert [r["case"] for r in rows] == list(sampler.CASES) and all(float(r["median_ms"]) > 0 for r in rows)
    assert rows[0]["settings"].startswith("python -m bench.sampler")


def test_parallel_sampling_bench_shares_the_prompt(tmp_path):
    args = ["--model", "tiny", "--n", "3", "--prompt-tokens", "64", "--max-tokens", "4", "--out", str(tmp_path)]
    assert parallel_sampling.main(args) == 0
    rows = _rows(next(tmp_path.glob("*-parallel-sampling.csv")))
    assert [r["prefix_cache"] for r in rows] == ["True", "True", "False", "False"]
    for group, separate in (rows[:2], rows[2:]):
        assert int(group["output_tokens"]) == int(separate["output_tokens"]) == 12
        assert int(group["prefill_tokens"]) == 64 + 2  # the prompt once, then each sibling's last token
        assert int(separate["prefill_tokens"]) >= 64 + 2 * 16  # each request at least its partial last block
        assert int(group["peak_used_blocks"]) < int(separate["peak_used_blocks"])
