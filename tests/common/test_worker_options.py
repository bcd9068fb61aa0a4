"""common/worker_options.py: each worker option declared once, parsed and passed on unchanged."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from common.worker_options import WorkerOptions, add_worker_options, option_specs

ROOT = Path(__file__).resolve().parents[2]
#: Flags other commands also take with their own meaning (the gateway's --redis-url and --model,
#: a benchmark's --dtype or --threads for its own engine, the credentials files); the rest are
#: the worker's alone and may be spelt only where they are declared.
SHARED = {"--redis-url", "--model", "--device", "--dtype",
          "--threads", "--batching", "--block-size", "--quantization", "--link-secret-file",
          "--redis-password-file", "--otlp-traces-endpoint"}
#: bench/profile_step.py --compare runs itself over older checkouts that lack common/worker_options.py.
OWN_DECLARATIONS = {"bench/profile_step.py"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_worker_options(p)
    return p


def _non_default(options: WorkerOptions) -> WorkerOptions:
    """Every option set to a value other than its default (and valid for its type)."""
    values = dict(redis_url="redis://worker@h:1/0", health_port=1, health_host="0.0.0.0", grpc_health_port=0,
                  worker_id="w-1", drain_grace_s=2.5, model="m.gguf", served_model_name=["m", "m-alias"],
                  device="cpu", dtype="bfloat16",
                  kv_cache_dtype="float16", quantization="q8_0", dense_weights_min_rows=0, threads=3,
                  no_adaptive_threads=True, deterministic=True, batching="dynamic", max_batch_size=7,
                  max_wait_ms=1.5, max_num_batched_tokens=99, long_prefill_token_threshold=5, block_size=32,
                  num_blocks=10, kv_cache_mib=64, policy="sjf", no_prefix_cache=True, no_kv_events=True,
                  disable_log_stats=True, stream_interval=4, speculative_config='{"method": "ngram"}', warmup_tokens=8,
                  link_secret_file="/s", redis_password_file="/p", otlp_traces_endpoint="http://c:4318",
                  enable_lora=True, lora_modules=["sql=/adapters/sql", "chat=/adapters/chat"], max_loras=3,
                  max_lora_rank=32, runner="pooling", pooler_config='{"pooling_type": "MEAN"}')
    assert set(values) == set(option_specs()), "a new option needs a value here"
    return options.replace(**values)


def test_every_option_passes_through_to_argv_and_back():
    given = _non_default(WorkerOptions())
    argv = given.to_argv(list(option_specs()))
    assert WorkerOptions.from_args(_parser().parse_args(argv)) == given
    assert WorkerOptions.from_args(_parser().parse_args([])) == WorkerOptions()  # the defaults are the fields'


def test_to_argv_spells_auto_true_flags_and_leaves_out_empty_values():
    options = WorkerOptions(deterministic=True)
    assert options.to_argv(["dense_weights_min_rows", "deterministic", "no_prefix_cache", "speculative_config",
                            "num_blocks"]) == ["--dense-weights-min-rows", "auto", "--deterministic"]
    with pytest.raises(KeyError):
        options.to_argv(["no_such_option"])


def test_another_command_overrides_a_help_line_and_a_default_only():
    p = argparse.ArgumentParser()
    add_worker_options(p, ["max_batch_size"], {"max_batch_size": {"default": 32, "help": None}})
    assert p.parse_args([]).max_batch_size == 32
    assert p.parse_args(["--max-batch-size", "4"]).max_batch_size == 4
    assert "sequences per batch" not in p.format_help()


def test_each_worker_flag_is_spelt_once_in_the_product():
    flags = {f for spec in option_specs().values() for f in spec[0]} - SHARED
    sources = [p for pkg in ("bench", "common", "gateway", "inflight", "stack", "worker", "inflight_kernels")
               for p in (ROOT / pkg).rglob("*.py")]
    where: dict[str, list[str]] = {}
    for path in sources:
        rel = str(path.relative_to(ROOT))
        if rel in OWN_DECLARATIONS:
            continue
        for flag in set(re.findall(r"[\"'](--[a-z0-9-]+)[\"']", path.read_text())) & flags:
            where.setdefault(flag, []).append(rel)
    bad = {f: sorted(p) for f, p in where.items() if p != ["common/worker_options.py"]}
    assert not bad, bad
    assert "--kv-cache-dtype" in where  # the scan sees the declarations
