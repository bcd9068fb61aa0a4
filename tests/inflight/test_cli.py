"""The ``inflight`` command line parses what the README and the deploy files use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from inflight.cli import build_parser, main


def test_bench_options_reach_the_benchmark():
    proc = subprocess.run([sys.executable, "-m", "inflight.cli", "bench", "--target", "engine", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--batching" in proc.stdout


def test_worker_flags_parse():
    args = build_parser().parse_args(["worker", "--policy", "fair", "--no-prefix-cache", "--health-host",
                                      "0.0.0.0", "--batching", "dynamic", "--max-wait-ms", "5"])
    assert (args.policy, args.no_prefix_cache, args.health_host, args.batching) == ("fair", True, "0.0.0.0", "dynamic")


def test_worker_grpc_health_port_reaches_the_settings():
    from inflight.cli import _worker_settings

    assert _worker_settings(build_parser().parse_args(["worker"])).grpc_health_port == 9101
    settings = _worker_settings(build_parser().parse_args(["worker", "--grpc-health-port", "0"]))
    assert settings.grpc_health_port == 0  # off


def test_keys_revoke_needs_an_id(capsys):
    assert main(["keys", "revoke"]) == 2
    assert "key id" in capsys.readouterr().err


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])


def test_worker_device_reaches_the_settings():
    from inflight.cli import _worker_settings

    assert _worker_settings(build_parser().parse_args(["worker"])).device == "auto"
    assert _worker_settings(build_parser().parse_args(["worker", "--device", "cpu"])).device == "cpu"


def test_worker_with_an_unusable_device_exits_2_before_starting(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["worker", "--device", "cuda", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_up_and_demo_hand_the_device_to_the_worker(tmp_path):
    from inflight.cli import _stack_settings

    args = build_parser().parse_args(["up", "--device", "cpu", "--no-nginx"])
    worker_args = _stack_settings(args, tmp_path).worker_args
    assert worker_args[worker_args.index("--device") + 1] == "cpu"
