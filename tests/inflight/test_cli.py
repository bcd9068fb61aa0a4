"""The ``inflight`` command line parses what the README and the deploy files use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.worker_options import WorkerOptions
from inflight.cli import build_parser, main


def _worker_settings(args):
    """The WorkerSettings ``inflight worker`` builds from parsed ``args`` (before its checks)."""
    from worker.serve.options import to_settings

    return to_settings(WorkerOptions.from_args(args))


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
    assert _worker_settings(build_parser().parse_args(["worker"])).device == "auto"
    assert _worker_settings(build_parser().parse_args(["worker", "--device", "cpu"])).device == "cpu"


def test_worker_with_an_unusable_device_exits_2_before_starting(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["worker", "--device", "cuda", "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_up_and_demo_hand_the_device_to_the_worker(tmp_path):
    from inflight.cli import _stack_settings

    for command in ("up", "demo"):
        args = build_parser().parse_args([command, "--device", "CPU", "--no-nginx"])
        worker_args = _stack_settings(args, tmp_path).worker_args
        assert worker_args[worker_args.index("--device") + 1] == "cpu"


@pytest.mark.parametrize("command", ["worker", "up", "demo"])
def test_a_misspelt_device_is_an_argparse_error(command):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--device", "gpu"])


def test_the_worker_runs_with_the_device_it_resolved(monkeypatch):
    import torch

    import worker.serve.main

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(worker.serve.main, "run_worker", lambda settings: seen.append(settings) or 0)
    assert main(["worker", "--device", "auto"]) == 0
    assert seen[0].device == "cpu" and seen[0].kv_cache_bytes is None  # None: the device's own default


def test_port_offset_moves_every_port_of_up_and_demo(tmp_path):
    from dataclasses import fields

    from inflight.cli import _stack_settings

    for command in ("up", "demo"):
        base = _stack_settings(build_parser().parse_args([command]), tmp_path)
        moved = _stack_settings(build_parser().parse_args([command, "--port-offset", "100", "--no-nginx"]), tmp_path)
        ports = [f.name for f in fields(base) if f.name.endswith("_port")]
        assert len(ports) == 7 and all(getattr(moved, p) == getattr(base, p) + 100 for p in ports)
        assert moved.use_nginx is False  # demo used to drop --no-nginx and --redis-url


def test_a_port_offset_past_65535_is_a_clear_error(capsys):
    assert main(["up", "--port-offset", "60000"]) == 2
    assert "outside 1..65535" in capsys.readouterr().err
    assert main(["demo", "--port-offset", "-9000"]) == 2


def test_kv_cache_dtype_reaches_the_worker_and_the_stack(tmp_path):
    from inflight.cli import _stack_settings

    assert _worker_settings(build_parser().parse_args(["worker"])).kv_cache_dtype == "auto"
    args = build_parser().parse_args(["worker", "--kv-cache-dtype", "float16"])
    assert _worker_settings(args).kv_cache_dtype == "float16"
    up = _stack_settings(build_parser().parse_args(["up", "--kv-cache-dtype", "float32"]), tmp_path)
    flag = up.worker_args.index("--kv-cache-dtype")
    assert up.worker_args[flag + 1] == "float32"


def test_stream_interval_reaches_the_worker_and_the_stack(tmp_path, capsys):
    from inflight.cli import _stack_settings

    assert _worker_settings(build_parser().parse_args(["worker"])).stream_interval == 1
    args = build_parser().parse_args(["worker", "--stream-interval", "8"])
    assert _worker_settings(args).stream_interval == 8
    up = _stack_settings(build_parser().parse_args(["up", "--stream-interval", "4"]), tmp_path)
    flag = up.worker_args.index("--stream-interval")
    assert up.worker_args[flag + 1] == "4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--stream-interval", "0"])
    assert "must be >= 1, got 0" in capsys.readouterr().err


def test_an_unusable_kv_cache_dtype_is_one_line_before_the_model_loads(monkeypatch, capsys):
    import torch

    import worker.model.device

    import worker.serve.main

    monkeypatch.setattr(worker.model.device, "resolve_device", lambda spec: torch.device("cuda", 0))
    monkeypatch.setattr(worker.serve.main, "run_worker", lambda settings: pytest.fail("the worker must not start"))
    code = main(["worker", "--device", "cuda", "--dtype", "bfloat16", "--kv-cache-dtype", "float16"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("inflight worker: kv_cache_dtype float16 differs from the compute dtype bfloat16")
    assert "Traceback" not in err


def test_up_refuses_an_unusable_kv_cache_dtype_in_one_line(monkeypatch, capsys, tmp_path):
    import torch

    import worker.model.device

    monkeypatch.setattr(worker.model.device, "resolve_device", lambda spec: torch.device("cuda", 0))
    code = main(["up", "--run-dir", str(tmp_path), "--device", "cuda", "--dtype", "bfloat16",
                 "--kv-cache-dtype", "float32"])
    assert code == 2
    assert capsys.readouterr().err.startswith("inflight up: kv_cache_dtype float32 differs from the compute dtype")


@pytest.mark.parametrize("flags, says", [
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be >= 1"),
    (["--long-prefill-token-threshold", "-5"], "long_prefill_token_threshold must be >= 0"),
])
def test_up_refuses_engine_settings_out_of_range_before_starting_anything(flags, says, capsys, tmp_path):
    """Checked with the stack's other options, in one line and exit 2, before Redis or a
    worker starts (the worker refused them only after the stack had started Redis)."""
    code = main(["up", "--run-dir", str(tmp_path), *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("inflight up: ") and says in err
    assert not any(tmp_path.iterdir()), "something was started"


def test_quantization_reaches_the_worker_and_the_stack(tmp_path):
    from inflight.cli import _stack_settings

    assert _worker_settings(build_parser().parse_args(["worker"])).quantization == "auto"
    args = build_parser().parse_args(["worker", "--quantization", "q8_0"])
    assert _worker_settings(args).quantization == "q8_0"
    up = _stack_settings(build_parser().parse_args(["up", "--quantization", "q8_0"]), tmp_path)
    flag = up.worker_args.index("--quantization")
    assert up.worker_args[flag + 1] == "q8_0"


def test_dense_weights_min_rows_reaches_the_worker_and_the_stack(tmp_path, monkeypatch):
    from inflight.cli import _stack_settings

    from worker.serve.main import _dense_min_rows

    default = _worker_settings(build_parser().parse_args(["worker"]))
    assert default.dense_weights_min_rows is None and _dense_min_rows(default) is None  # auto
    deterministic = _worker_settings(build_parser().parse_args(["worker", "--deterministic"]))
    assert _dense_min_rows(deterministic) == 0  # auto is off there
    for text, want in (("16", 16), ("0", 0), ("auto", None)):
        args = build_parser().parse_args(["worker", "--dense-weights-min-rows", text])
        assert _worker_settings(args).dense_weights_min_rows == want
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--dense-weights-min-rows", "-1"])
    monkeypatch.setattr("worker.model.dense_weights.check_dense_min_rows", lambda *a: None)  # any CPU
    for given, passed in ((["--dense-weights-min-rows", "16"], "16"), ([], "auto")):
        up = _stack_settings(build_parser().parse_args(["up", *given]), tmp_path)
        flag = up.worker_args.index("--dense-weights-min-rows")
        assert up.worker_args[flag + 1] == passed


def test_dense_weights_with_deterministic_are_one_line_before_the_model_loads(monkeypatch, capsys, tmp_path):
    import worker.serve.main
    from inflight.cli import _stack_settings

    monkeypatch.setattr(worker.serve.main, "run_worker", lambda settings: pytest.fail("the worker must not start"))
    code = main(["worker", "--device", "cpu", "--deterministic", "--dense-weights-min-rows", "16"])
    assert code == 2
    err = capsys.readouterr().err
    assert "which --deterministic refuses" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="which --deterministic refuses"):
        _stack_settings(build_parser().parse_args(["up", "--deterministic", "--dense-weights-min-rows", "8"]), tmp_path)


def test_dense_weights_without_gguf_blocks_are_one_line_before_the_model_loads(monkeypatch, capsys):
    import worker.serve.main

    monkeypatch.setattr(worker.serve.main, "run_worker", lambda settings: pytest.fail("the worker must not start"))
    code = main(["worker", "--device", "cpu", "--quantization", "none", "--dense-weights-min-rows", "16"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("inflight worker: --dense-weights-min-rows multiplies GGUF blocks") and "Traceback" not in err


def test_an_unusable_quantization_is_one_line_before_the_model_loads(monkeypatch, capsys):
    import worker.serve.main

    monkeypatch.setattr(worker.serve.main, "run_worker", lambda settings: pytest.fail("the worker must not start"))
    code = main(["worker", "--device", "cpu", "--dtype", "bfloat16", "--quantization", "q8_0"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("inflight worker: --quantization q8_0 computes in float32")
    assert "Traceback" not in err


def test_gguf_for_a_model_folder_is_one_line_before_the_model_loads(monkeypatch, capsys, tmp_path):
    import json

    import worker.serve.main

    monkeypatch.setattr(worker.serve.main, "run_worker", lambda settings: pytest.fail("the worker must not start"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["worker", "--device", "cpu", "--model", str(tmp_path), "--quantization", "gguf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inflight worker: --quantization gguf keeps a GGUF file's blocks") and "Traceback" not in err


def test_an_unsupported_architecture_is_one_line_naming_the_supported_ones(monkeypatch, capsys, tmp_path):
    import json

    import worker.serve.main

    monkeypatch.setattr(worker.serve.main, "run_worker", lambda settings: pytest.fail("the worker must not start"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 64}))
    assert main(["worker", "--device", "cpu", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == ("inflight worker: model_type 'gpt_neox' unsupported (supported: llama, mistral, qwen2, qwen3, "
                   "phi3, gemma2, gemma3_text)\n")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 8, "vocab_size": 8, "rope_scaling": {"rope_type": "mrope", "factor": 2.0}}))
    assert main(["up", "--run-dir", str(tmp_path / "run"), "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("inflight up: RoPE type 'mrope' unsupported (supported: default, ")


def test_keys_limits_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["keys", "create", "--rpm", "-3"])
    assert "must be >= 0, got -3" in capsys.readouterr().err


def test_keys_with_redis_unreachable_is_one_line(capsys):
    from tests.helpers.redis_server import free_port

    code = main(["keys", "list", "--redis-url", f"redis://127.0.0.1:{free_port()}/0"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("inflight keys: Redis at redis://127.0.0.1:") and "Traceback" not in err


def test_keys_as_a_redis_user_without_the_rights_is_one_line(redis_url, tmp_path, capsys):
    """``inflight keys create`` as a Redis user the ACL keeps off the key store (the gateway's,
    whose URL ``inflight up`` shows beside the admin's) said NOPERM in a traceback."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.acl_setuser("limited", enabled=True, passwords=["+pw"], keys=["other:*"], commands=["+@all"])
    try:
        password = tmp_path / "pw"
        password.write_text("pw")
        password.chmod(0o600)
        url = redis_url.replace("redis://", "redis://limited@", 1)
        code = main(["keys", "create", "--tenant", "t", "--redis-url", url, "--redis-password-file", str(password)])
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("inflight keys: Redis at ") and "user admin" in err
    finally:
        client.acl_deluser("limited")
        client.close()


def test_worker_long_prefill_threshold_reaches_the_settings():
    assert _worker_settings(build_parser().parse_args(["worker"])).engine.long_prefill_token_threshold == 0
    args = build_parser().parse_args(["worker", "--long-prefill-token-threshold", "256"])
    assert _worker_settings(args).engine.long_prefill_token_threshold == 256


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_refuses_a_second_model_in_one_line(command, capsys):
    """argparse kept the last --model: ``up --model A --model B`` silently served only B."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([command, "--model", "a.gguf", "--model", "b.gguf"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model given twice" in err and "docs/MODELS.md" in err
    assert build_parser().parse_args([command, "--model", "a.gguf"]).model == "a.gguf"


@pytest.mark.parametrize("command", ["up", "demo"])
def test_chunked_prefill_knobs_reach_the_stack_worker(command, tmp_path):
    """A 7,000-token prompt held up every new request under ``inflight up``, which had no flag
    for the worker's chunked-prefill budget or vLLM's long-prefill threshold."""
    from inflight.cli import _stack_settings

    args = build_parser().parse_args([command, "--max-num-batched-tokens", "512",
                                      "--long-prefill-token-threshold", "256"])
    worker_args = _stack_settings(args, tmp_path).worker_args
    assert worker_args[worker_args.index("--max-num-batched-tokens") + 1] == "512"
    assert worker_args[worker_args.index("--long-prefill-token-threshold") + 1] == "256"
    worker = build_parser().parse_args(["worker", *worker_args])  # the worker parses what it is given
    assert _worker_settings(worker).engine.long_prefill_token_threshold == 256


def test_up_sets_the_edge_rate_limits(tmp_path, capsys):
    """``inflight up`` had no flag for the nginx edge's per-IP/per-key limits (10 r/s, burst 20)."""
    from inflight.cli import _stack_settings
    from stack.edge import render_config
    from stack.stack import Stack

    args = build_parser().parse_args(["up", "--ip-rate", "50", "--ip-burst", "100", "--key-rate", "40",
                                      "--key-burst", "80", "--key-conns", "16", "--port-offset", "100"])
    config = render_config(Stack(_stack_settings(args, tmp_path), None).edge_settings())
    assert "zone=per_ip:10m rate=50r/s" in config and "zone=per_key:10m rate=40r/s" in config
    assert "zone=per_ip burst=100 nodelay" in config and "zone=per_key burst=80 nodelay" in config
    assert "limit_conn conn_per_key 16;" in config
    default = render_config(Stack(_stack_settings(build_parser().parse_args(["up"]), tmp_path), None).edge_settings())
    assert "zone=per_ip:10m rate=10r/s" in default and "zone=per_ip burst=20 nodelay" in default
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--ip-rate", "0"])
    assert "must be >= 1, got 0" in capsys.readouterr().err


def test_keys_read_the_redis_url_from_the_environment(redis_url, monkeypatch, capsys):
    """A user's key went to the machine's own Redis (the silent default), not the stack's:
    ``INFLIGHT_REDIS_URL`` names the stack's when ``--redis-url`` is absent, without a notice."""
    monkeypatch.setenv("INFLIGHT_REDIS_URL", redis_url)
    assert main(["keys", "create", "--tenant", "from-env", "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and out.out.strip()
    monkeypatch.delenv("INFLIGHT_REDIS_URL")
    assert main(["keys", "list", "--redis-url", redis_url]) == 0
    assert "tenant=from-env" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["keys", "list"], ["status"]])
def test_the_default_redis_is_said_on_stderr_and_a_failure_is_one_line(command, monkeypatch, capsys):
    """Without --redis-url or INFLIGHT_REDIS_URL the default is named on stderr (here moved to a
    free port: the tests never touch the machine's Redis), and its failure is one line naming
    the URL and how to pass the stack's."""
    import common.cli_args
    from tests.helpers.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    monkeypatch.delenv("INFLIGHT_REDIS_URL", raising=False)
    monkeypatch.setattr(common.cli_args, "DEFAULT_REDIS_URL", url)
    assert main(command) == 1
    notice, failure = capsys.readouterr().err.strip().splitlines()
    assert notice.startswith(f"inflight {command[0]}: using {url}, this machine's own Redis")
    assert "INFLIGHT_REDIS_URL" in notice and "inflight up" in notice
    assert f"Redis at {url}" in failure and "--redis-url" in failure and "INFLIGHT_REDIS_URL" in failure


def test_up_stops_on_sigint_even_when_started_with_sigint_ignored(monkeypatch, tmp_path):
    """A background job of a non-interactive shell starts with SIGINT ignored: `inflight up` takes
    it back, so `kill -INT` (or Ctrl-C after `fg`) stops the stack like SIGTERM does."""
    import signal

    import stack.stack

    seen = []

    class FakeStack:
        def __init__(self, *args):
            pass

        def start(self):
            seen.append(signal.getsignal(signal.SIGINT))
            raise KeyboardInterrupt  # what the handler raises on SIGINT while starting

    monkeypatch.setattr(stack.stack, "Stack", FakeStack)
    monkeypatch.setattr("inflight.cli._check_chat_template", lambda model: None)
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["up", "--run-dir", str(tmp_path)]) == 130
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    assert seen == [signal.default_int_handler]
