"""The one-shot GPU engine check (bench/gpu_engine.py) runs its harness on the
CPU (both sides on the CPU), catches a wrong model, and its ``shape`` /
``random-weights`` pair yields a model folder the worker loads."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from bench import gpu_engine as g


@pytest.fixture()
def cpu_harness(monkeypatch):
    monkeypatch.setattr(g, "DEVICE", "cpu")


def test_checks_pass_when_both_sides_agree(cpu_harness, tmp_path, capsys):
    rows = g.run_checks()
    assert len(rows) == 2 * len(g.SHAPES) + 3 and all(r["ok"] for r in rows), rows
    g.print_table(rows)
    g.write_csv(tmp_path / "r.csv", rows)
    assert "7/7 checks passed" in capsys.readouterr().out
    assert {r["device"] for r in csv.DictReader((tmp_path / "r.csv").open())} == {"cpu"}


def test_a_wrong_model_on_the_device_side_fails(cpu_harness, monkeypatch):
    made = []
    real = g.runner_for

    def second_differs(config, dtype, device, num_blocks=256, seed=0, qk_std=0.3):
        made.append(device)
        return real(config, dtype, device, num_blocks, seed + (len(made) == 2), qk_std)

    monkeypatch.setattr(g, "runner_for", second_differs)
    row = g.check_paged_steps("smollm2-attn", g.SHAPES["smollm2-attn"], torch.float32)
    assert not row["ok"] and row["rel_err"] > 1e-2


def test_a_crashing_check_is_a_failed_row():
    (row,) = g._guarded(lambda: 1 / 0)
    assert not row["ok"] and "ZeroDivisionError" in row["error"]


def test_check_without_cuda_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert g.main(["check", "--out", str(tmp_path / "x.csv")]) == 2


def test_shape_and_random_weights_make_a_loadable_model(cpu_harness, tmp_path, capsys):
    from common.tokenizer import load_tokenizer
    from worker.model.model_runner import load_model_runner

    folder = tmp_path / "smol"
    assert g.main(["shape", "smollm2", str(folder)]) == 0
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_key_value_heads"], config["vocab_size"]) == (576, 3, 49152)
    config["num_hidden_layers"] = 2  # keep the test small
    (folder / "config.json").write_text(json.dumps(config))
    assert g.main(["random-weights", str(folder)]) == 0
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    from common.model_files import default_model_path

    gguf_tok, copy_tok = load_tokenizer(default_model_path()), load_tokenizer(folder)
    assert copy_tok.apply_chat_template(messages) == gguf_tok.apply_chat_template(messages)
    assert copy_tok.encode("Paris, 2026!") == gguf_tok.encode("Paris, 2026!")
    assert copy_tok.eos_token_ids == gguf_tok.eos_token_ids
    runner = load_model_runner(folder, dtype="float32", num_blocks=64)
    assert runner.dtype == torch.float32 and runner.config.num_layers == 2
    g.step_times(folder, [1, 2])
    assert "decode step batch    2" in capsys.readouterr().out
