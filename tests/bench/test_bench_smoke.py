"""Smoke tests of ``inflight bench`` on the tiny random model: it runs every
mode and the HF peers, and writes a table, a CSV and a PNG. No timings are asserted."""

from __future__ import annotations

import csv
import math
import sys

import pytest
import torch

from bench.ceiling import Hardware, ModelCost, ceiling, measure
from bench.cli import main
from bench.metrics import SLO, RequestRecord, percentiles, summarize, time_weighted_mean
from bench.workloads import WorkloadSpec, length_pmf, load_prompts, make_workload, mean_length, request_level_bound


def test_workload_is_seeded_and_in_range():
    spec = WorkloadSpec(num_requests=20, rate=4.0, min_tokens=16, max_tokens=512, seed=3)
    a, b = make_workload(spec, load_prompts()), make_workload(spec, load_prompts())
    assert a == b
    assert all(16 <= r.output_tokens <= 512 for r in a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    closed = make_workload(WorkloadSpec(num_requests=5), load_prompts())
    assert {r.arrival_s for r in closed} == {0.0}
    assert len(load_prompts()) >= 20


def test_log_uniform_lengths_are_long_tailed_and_bounds_are_exact():
    spec = WorkloadSpec(num_requests=2000, min_tokens=16, max_tokens=512, output_dist="log-uniform")
    lengths = [r.output_tokens for r in make_workload(spec, load_prompts())]
    assert min(lengths) >= 16 and max(lengths) <= 512
    short, long = sum(16 <= n < 32 for n in lengths), sum(256 <= n < 512 for n in lengths)
    assert 0.8 < short / long < 1.25  # one octave each: equally likely
    assert sum(length_pmf(spec).values()) == pytest.approx(1.0)
    assert mean_length(spec) == pytest.approx(496 / math.log(513 / 16), rel=0.01)  # (b - a) / ln(b / a)
    uniform = WorkloadSpec(min_tokens=16, max_tokens=512)
    assert mean_length(uniform) == pytest.approx(264)
    assert request_level_bound(uniform, 1) == pytest.approx(1.0)
    # two draws from {1, 2}: E[max] = 1.75, E[len] = 1.5
    assert request_level_bound(WorkloadSpec(min_tokens=1, max_tokens=2), 2) == pytest.approx(1.75 / 1.5)
    assert 1.8 < request_level_bound(uniform, 32) < 1.9 < 3.2 < request_level_bound(spec, 32) < 3.3
    with pytest.raises(ValueError, match="output_dist"):
        make_workload(WorkloadSpec(output_dist="zipf"), load_prompts())


def test_metrics_follow_their_definitions():
    r = RequestRecord("r", arrival_s=1.0, requested_tokens=3, token_times=[1.5, 2.0, 2.5], end_s=2.5, output_tokens=3)
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(1.5) and r.tpot_s == pytest.approx(0.5)
    s = summarize([r], SLO(ttft_s=1.0, itl_s=1.0), [(0.0, 0), (1.0, 2), (2.0, 2)])
    assert s.output_tok_s == pytest.approx(3 / 2.5) and s.goodput_req_s == pytest.approx(1 / 2.5)
    assert s.mean_running == pytest.approx(1.0)
    assert percentiles([1.0, 2.0, 3.0]).p50 == 2.0
    assert time_weighted_mean([(0.0, 4), (1.0, 0), (3.0, 0)]) == pytest.approx(4 / 3)


def test_ceiling_is_the_roofline():
    hw = Hardware("bfloat16", 2048, matmul_flops=2e12, bandwidth=1e10)
    cost = ModelCost(params=1_000_000_000, weight_bytes=2_000_000_000)
    c = ceiling(hw, cost, batch=8)
    assert c.compute_tok_s == pytest.approx(1000.0) and c.memory_tok_s == pytest.approx(40.0)
    assert c.tok_s == pytest.approx(40.0)


def test_cli_runs_every_mode_and_hf_peers(tmp_path, capsys):
    rc = main(["--model", "tiny", "--num-requests", "6", "--min-tokens", "2", "--max-tokens", "10",
               "--max-batch-size", "4", "--rate", "50", "--peer", "hf-generate", "--peer", "hf-cb",
               "--ceiling-n", "128", "--ceiling-mib", "4", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| inflight-engine | continuous |" in out
    assert "cpu (inflight-engine, continuous): CPU over" in out and "CPU ms per output token" in out
    (csv_path,) = tmp_path.glob("*.csv")
    rows = list(csv.DictReader(csv_path.open()))
    assert all(float(r["cpu_s_client"]) > 0 for r in rows[:3]) and rows[3]["cpu_s_client"] == ""
    assert all(float(r["cpu_idle_s"]) >= 0 and int(r["cpu_cores"]) >= 1 for r in rows[:3])
    assert [(r["system"], r["mode"]) for r in rows] == [
        ("inflight-engine", "static"), ("inflight-engine", "dynamic"), ("inflight-engine", "continuous"),
        ("hf-generate", "static"), ("hf-cb", "continuous")]
    assert all(r["completed"] == "6" and r["failed"] == "0" for r in rows)
    assert {r["output_tokens"] for r in rows} == {rows[0]["output_tokens"]}  # same tokens everywhere
    assert list(tmp_path.glob("*.png"))


def test_cli_rejects_a_bad_peer():
    with pytest.raises(SystemExit):
        main(["--peer", "llama-server"])  # the binary path is missing


def test_cli_shared_prefix_compares_prefix_cache_on_and_off(tmp_path, capsys):
    rc = main(["--model", "tiny", "--batching", "continuous", "--num-requests", "4", "--min-tokens", "2",
               "--max-tokens", "4", "--max-batch-size", "2", "--shared-prefix-tokens", "64",
               "--prefix-cache", "on,off", "--ceiling-n", "128", "--ceiling-mib", "4", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| inflight-engine | continuous+pc |" in out and "| inflight-engine | continuous-nopc |" in out
    assert "prefix cache (inflight-engine, continuous): hit ratio" in out
    (csv_path,) = tmp_path.glob("*.csv")
    rows = {r["mode"]: r for r in csv.DictReader(csv_path.open())}
    assert float(rows["continuous+pc"]["prefix_cache_hit_ratio"]) > 0.3  # 3 of 4 requests reuse ~64 tokens
    assert float(rows["continuous-nopc"]["prefix_cache_hit_ratio"]) == 0.0


def test_cli_device_is_for_the_engine_target_alone(monkeypatch):
    from worker.model import device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(device, "cupy_installed", lambda: True)
    with pytest.raises(SystemExit, match="engine target alone"):
        main(["--device", "cuda", "--peer", "hf-cb"])
    with pytest.raises(SystemExit, match="engine target alone"):
        main(["--device", "cuda", "--target", "stack"])


def test_cli_cuda_without_a_gpu_is_a_clear_exit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="sees no CUDA GPU"):
        main(["--device", "cuda", "--model", "tiny"])


def test_no_peers_imports_no_peer_module(monkeypatch):
    """The peers need the gRPC stubs and transformers; a GPU machine may have neither at the right version."""
    from argparse import Namespace

    from bench.cli import _peer_runs

    monkeypatch.setitem(sys.modules, "bench.peers", None)  # importing it now raises
    assert _peer_runs(Namespace(peer=[]), None, None, []) == []
    with pytest.raises(ImportError):
        _peer_runs(Namespace(peer=[["hf-cb"]]), None, None, [])


def test_ceiling_probes_wait_for_the_gpu_only_on_a_gpu(monkeypatch):
    from bench import ceiling as c

    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    c.best_seconds(lambda: None, 3, torch.device("cuda"))
    assert len(syncs) == 4  # after the warm-up and after each timed call: the kernels' time is counted
    hw = measure(torch.float32, n=64, nbytes=1 << 16, device=torch.device("cpu"))
    assert hw.matmul_flops > 0 and hw.bandwidth > 0 and len(syncs) == 4


def test_cli_device_auto_is_the_cpu_here_so_peers_may_run(monkeypatch):
    from bench.cli import _device_type

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _device_type("auto") == "cpu"
    with pytest.raises(SystemExit):
        main(["--device", "gpu"])


def test_openmp_teams_script_prints_a_row_per_variant(capsys):
    from bench import openmp_teams

    assert openmp_teams.main(["--model", "tiny", "--num-requests", "3", "--max-tokens", "18"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()[2:]
    assert [r.split(" | ")[0].strip("| ") for r in rows] == list(openmp_teams.VARIANTS)
    assert all(float(r.split(" | ")[1]) > 0 for r in rows)
