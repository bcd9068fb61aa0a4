"""bench/two_models.py on the tiny random model, its smallest run: two model processes, each
alone then both at once, a CSV row per model and case plus the aggregate, and the printed
table beside the CSV. No timing is asserted (a loaded CI machine)."""

import csv

from bench import two_models


def test_two_models_bench_rows(tmp_path, capsys):
    assert two_models.main(["--model-a", "tiny", "--requests", "2", "--batch", "1", "--max-tokens", "3",
                            "--threads", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-two-models.csv")
    rows = list(csv.DictReader(path.open()))
    assert [(r["case"], r["model"]) for r in rows] == [("alone", "A"), ("alone", "B"), ("both", "A"), ("both", "B"),
                                                       ("both", "A+B")]
    assert [int(r["tokens"]) for r in rows] == [6, 6, 6, 6, 12]  # 2 requests x 3 tokens per model
    assert all(float(r["tok_s"]) > 0 and float(r["ttft_p50_ms"]) > 0 for r in rows)
    assert [r["tok_s_vs_alone"] for r in rows[:2]] == ["1.0", "1.0"]
    assert rows[-1]["name"] == "aggregate" and rows[0]["threads"] == "1"
    printed = capsys.readouterr().out
    text = path.with_suffix(".txt").read_text()
    assert "x tok/s" in printed and text.splitlines()[:7] == printed.splitlines()[:7]
