"""bench/lora.py on the tiny random model: the five steps timed, a CSV row each (the product
each LoRA step used named), and the adapters it writes load as PEFT adapters of the model."""

import csv

import inflight_kernels
from bench import lora


def test_lora_bench_rows(tmp_path):
    assert lora.main(["--model", "tiny", "--batch", "4", "--adapters", "2", "--rank", "4", "--context", "16",
                      "--repeats", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-lora.csv")
    rows = list(csv.DictReader(path.open()))
    assert [r["step"] for r in rows] == ["base", "base, layer path", "2 adapters", "base + 2 adapters",
                                         "2 adapters, masked"]
    assert [int(r["adapters"]) for r in rows] == [0, 0, 2, 2, 2]
    product = "grouped" if inflight_kernels.cpu_kernels_available() else "masked"
    assert [r["lora_product"] for r in rows] == ["", "", product, product, "masked"]
    assert rows[0]["vs_base"] == "1.0" and all(float(r["forward_ms"]) > 0 for r in rows)
