"""The ``inflight`` command: ``up``, ``demo``, ``worker``, ``gateway``, ``keys``, ``tokenizer``, ``bench``.

Settings dataclasses are built here, once, from the arguments, and passed in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from common.cli_types import auto_or_non_negative_int, device_spec, non_negative_int, positive_int
from common.logs import configure_logging

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


DETERMINISTIC_HELP = ("batch-invariant mode (SGLang's --enable-deterministic-inference): start only where every "
                      "op of the step gives a row the same bits whatever else is in the batch (compiled CPU "
                      "kernels; prepacked float32/bfloat16 or q8_0 projections; not CUDA), and keep the thread "
                      "count fixed; a request's greedy text and logprobs then do not depend on other traffic")
SPEC_CONFIG_HELP = ("speculative decoding, vLLM's JSON form: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                    "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": 4}' (draft tokens "
                    "by prompt lookup, verified in one forward pass; greedy output unchanged, sampled output "
                    "distributed as without it). Default: off")


def _add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", type=device_spec,
                   help="auto (a CUDA GPU when torch sees one and CuPy is installed, else the CPU), cpu, cuda "
                        "or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache element type (default auto: the compute dtype; float16 for float32 compute on "
                        "a CPU with the compiled attention kernel, as llama.cpp's default f16 cache; bfloat16 "
                        "with --quantization q8_0, or gguf with bfloat16 activations, where that kernel has the "
                        "AVX-512 BF16 path)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "q8_0", "q4_1", "gguf"],
                   help="gguf: a GGUF file's Q4_1 and Q8_0 tensors keep their blocks and run weight-only "
                        "(float32 activations, the weights dequantized in registers), as vLLM's gguf; "
                        "q8_0: int8 weights and activations, one scale per 32 values (llama.cpp's Q8_0), a quarter "
                        "of the float32 weight bytes; q4_1: 4-bit projections with a scale and a minimum per 32 "
                        "values (llama.cpp's Q4_1, the default GGUF's own blocks) and a Q8_0 lm_head, int8 "
                        "activations; all three CPU and float32 only; none keeps the float weights; auto "
                        "(default): gguf for a GGUF file whose projections are all Q4_1 or Q8_0, on the CPU "
                        "with --dtype auto or float32, else none")
    p.add_argument("--dense-weights-min-rows", type=auto_or_non_negative_int, default=None, metavar="ROWS",
                   help="with a GGUF file's Q4_1/Q8_0 blocks and bfloat16 activations (a CPU with AVX-512 BF16): "
                        "steps of at least ROWS rows multiply dense bfloat16 copies of the weights instead (on "
                        "oneDNN's AMX tiles where the CPU has them), faster once a step is bound by arithmetic, at "
                        "2 bytes per weight more memory; results then depend on the step's row count, so "
                        "--deterministic refuses a count; 0: off; auto (default): 16 where the blocks take bfloat16 "
                        "activations, off when the copies would take over a quarter of the memory left after "
                        "loading, and off with --deterministic")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for the model (default: the smaller of the CPUs in the affinity mask and "
                        "the cgroup CPU quota, rounded down; the log says which)")
    p.add_argument("--no-adaptive-threads", action="store_true",
                   help="keep the thread count fixed; by default a CPU worker without --threads gives a thread "
                        "up while other processes take CPUs of its affinity mask, and takes it back when they stop")
    p.add_argument("--deterministic", "--enable-deterministic-inference", action="store_true",
                   help=DETERMINISTIC_HELP)
    p.add_argument("--batching", default="continuous", choices=["continuous", "static", "dynamic"])
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="sequences per batch (default: 64 continuous, 8 static, 32 dynamic)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="dynamic batching wait (ms)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="most prompt tokens one request prefills per step, so shorter prompts are admitted "
                        "beside a long one's prefill instead of waiting for all of it (0 = off, as vLLM's)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-mib", type=int, default=None,
                   help="KV cache size (default: 512 MiB on the CPU, 90%% of the GPU memory left after the weights)")
    p.add_argument("--policy", default="fcfs", choices=["fcfs", "sjf", "fair"],
                   help="waiting-queue order (priority 0 always first)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    p.add_argument("--no-kv-events", action="store_true",
                   help="do not publish the prefix cache's block hashes and the load to Redis (the gateway's "
                        "KV-aware router then never picks this worker; it serves the shared streams)")
    p.add_argument("--stream-interval", type=positive_int, default=1,
                   help="tokens per streamed chunk after the first (default 1: every token at once; larger "
                        "values send fewer, bigger chunks, as SGLang's and vLLM's --stream-interval)")
    p.add_argument("--speculative-config", default="", metavar="JSON", help=SPEC_CONFIG_HELP)
    p.add_argument("--warmup-tokens", type=int, default=256,
                   help="prompt length of the warm-up forward pass run before reporting ready")


def _add_tracing_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry traces over OTLP to URL (vLLM's flag; the same as "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Off by default; the OTEL_* variables "
                        "(OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, ...) work too")


def _worker_settings(args):
    from worker.serve.settings import WorkerSettings

    from worker.engine.engine_config import EngineConfig, SpeculativeConfig

    default_batch = {"continuous": 64, "static": 8, "dynamic": 32}[args.batching]
    max_batch_size = args.max_batch_size or default_batch
    engine = EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=max_batch_size,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          long_prefill_token_threshold=args.long_prefill_token_threshold, batching=args.batching,
                          max_batch_size=None if args.batching == "continuous" else max_batch_size,
                          max_wait_ms=args.max_wait_ms, policy=args.policy,
                          enable_prefix_caching=not args.no_prefix_cache,
                          speculative=SpeculativeConfig.from_json(args.speculative_config))
    kw = dict(redis_url=args.redis_url, model=args.model, device=args.device, dtype=args.dtype,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              dense_weights_min_rows=args.dense_weights_min_rows, engine=engine,
              threads=args.threads, adaptive_threads=not args.no_adaptive_threads,
              deterministic=args.deterministic,
              kv_cache_bytes=None if args.kv_cache_mib is None else args.kv_cache_mib * 1024 * 1024,
              health_port=args.health_port, health_host=args.health_host,
              grpc_health_port=args.grpc_health_port, warmup_tokens=args.warmup_tokens,
              stream_interval=args.stream_interval, drain_grace_s=args.drain_grace_s,
              otlp_traces_endpoint=args.otlp_traces_endpoint or "",
              kv_events=not getattr(args, "no_kv_events", False))
    if args.worker_id:
        kw["worker_id"] = args.worker_id
    kw["link_secret"] = _link_secret(args)
    kw["redis_password"] = _redis_password(args)
    return WorkerSettings(**kw)


def _link_secret(args) -> str | None:
    """The link secret of ``--link-secret-file``, ``INFLIGHT_LINK_SECRET_FILE`` or
    ``INFLIGHT_LINK_SECRET`` (None when none is set). Raises ValueError for an unreadable
    or empty file (one line for the caller to print)."""
    from common.credentials import link_secret

    try:
        return link_secret(args.link_secret_file, os.environ)
    except OSError as exc:
        raise ValueError(f"cannot read the link secret: {exc}") from exc


def _check_redis_url(url: str) -> None:
    """Raise ValueError now for a malformed ``redis+sentinel://`` URL (common/redis_connect.py)."""
    from common.redis_connect import is_sentinel_url, parse_sentinel_url

    if is_sentinel_url(url):
        parse_sentinel_url(url)


def _redis_password(args) -> str | None:
    """The password of ``--redis-password-file`` or ``INFLIGHT_REDIS_PASSWORD_FILE`` (None:
    the URL's, or none). Raises ValueError for an unreadable or empty file."""
    from common.credentials import redis_password

    try:
        return redis_password(args.redis_password_file, os.environ)
    except OSError as exc:
        raise ValueError(f"cannot read the Redis password: {exc}") from exc


def cmd_worker(args) -> int:
    from worker.model.device import resolve_device
    from worker.serve.main import run_worker

    try:
        device = resolve_device(args.device)  # an unusable --device fails here, in one line, before anything starts
        _check_kv_cache_dtype(args.kv_cache_dtype, args.dtype, device)  # and so does an unusable cache dtype
        # dense copies with --deterministic: a conflict of the flags whatever the CPU, so said first
        _check_dense_deterministic(args.dense_weights_min_rows, args.deterministic)
        _check_quantization(args.quantization, args.dtype, device, args.model,  # and an unusable quantization
                            args.dense_weights_min_rows)
        settings = _worker_settings(args)  # and an engine setting out of range
        _check_redis_url(args.redis_url)  # and a malformed redis+sentinel:// URL
        _check_model(args.model)  # and a missing model, an unsupported architecture, quantization or RoPE type
    except ValueError as exc:
        print(f"inflight worker: {exc}", file=sys.stderr)
        return 2
    from worker.model.gguf_check import ModelTooLarge

    try:
        return run_worker(dataclasses.replace(settings, device=str(device)))
    except ModelTooLarge as exc:  # known once the quantization is resolved, as the load starts
        print(f"inflight worker: {exc}", file=sys.stderr)
        return 2


def _check_model(model: str | None) -> None:
    """Raise ValueError now, before anything starts, when the model is missing or its
    architecture, a GGUF tensor's type or its RoPE type is unsupported (read from the
    config or the GGUF header: :func:`worker.model.loader.check_model`)."""
    from common.model_files import resolve_model_path
    from worker.model.loader import check_model

    try:
        check_model(resolve_model_path(model))
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc


def _check_kv_cache_dtype(kv_cache_dtype: str, dtype: str, device) -> None:
    """Raise ValueError now, before the weights load, when ``--kv-cache-dtype``
    cannot be used with ``--dtype`` on ``device`` (see
    :func:`worker.model.dtype.resolve_kv_cache_dtype`); "auto" always can."""
    if kv_cache_dtype == "auto":
        return
    from worker.model.dtype import resolve_dtype, resolve_kv_cache_dtype

    resolve_kv_cache_dtype(kv_cache_dtype, resolve_dtype(dtype, device, 0, 0), device, 0)


def _check_dense_deterministic(dense_min_rows: int | None, deterministic: bool) -> None:
    """Raise ValueError now, before the weights load, for ``--dense-weights-min-rows N`` (N > 0)
    with ``--deterministic``, which refuses what makes a row's result depend on its batch
    (:func:`worker.model.determinism.batch_invariance_problems`; ``auto`` is off there)."""
    if deterministic and dense_min_rows:
        raise ValueError(f"--dense-weights-min-rows {dense_min_rows} makes a row's result depend on how many rows "
                         "share its step, which --deterministic refuses: leave it at auto or 0")


def _check_quantization(quantization: str, dtype: str, device, model: str | None,
                        dense_min_rows: int | None = 0) -> None:
    """Raise ValueError now, before the weights load, when ``--quantization``
    cannot run with ``--dtype`` on ``device`` for ``model``
    (:func:`worker.model.quantization.resolve_quantization`, :func:`~worker.model.quantization.compute_dtype`),
    or ``--dense-weights-min-rows`` has no blocks to copy (:func:`~worker.model.quantization.check_dense_min_rows`)."""
    if quantization not in ("auto", "none") or dense_min_rows:  # None (auto) and 0 need no check
        from common.model_files import resolve_model_path
        from worker.model.gguf_check import check_gguf_file
        from worker.model.quantization import (check_dense_min_rows, compute_dtype, gguf_bf16_activations,
                                               resolve_quantization)

        try:
            path = resolve_model_path(model)
        except FileNotFoundError:
            return  # _check_model says so
        if path.suffix == ".gguf":
            check_gguf_file(path)  # a truncated or corrupt file in one line, before GGUFReader maps it
        resolved = resolve_quantization(quantization, path, dtype, device)
        compute_dtype(resolved, dtype, device)
        if dense_min_rows:
            check_dense_min_rows(dense_min_rows, resolved, resolved == "gguf" and gguf_bf16_activations(dtype))


def cmd_gateway(args) -> int:
    from gateway.main import run
    from gateway.settings import GatewaySettings

    try:
        secret, password = _link_secret(args), _redis_password(args)
    except ValueError as exc:
        print(f"inflight gateway: {exc}", file=sys.stderr)
        return 2
    # INFLIGHT_GATEWAY_<FIELD> variables set what has no flag (e.g. MAX_QUEUE_DEPTH); flags win.
    try:
        _check_redis_url(args.redis_url)
        settings = _gateway_settings(args, GatewaySettings, secret, password)
        _check_chat_template(settings.model_path)  # a broken template fails here, not at the first chat request
    except ValueError as exc:
        print(f"inflight gateway: {exc}", file=sys.stderr)
        return 2
    run(settings)
    return 0


def _check_chat_template(model: str | None) -> None:
    """Raise ValueError now when the model's chat template does not render a user
    message (:func:`common.chat_template.check_chat_template`); log, as an error,
    that a model without one serves completions only."""
    import logging

    from common.chat_template import check_chat_template
    from common.model_files import resolve_model_path
    from common.tokenizer import load_tokenizer

    try:
        notice = check_chat_template(load_tokenizer(resolve_model_path(model)))
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc
    if notice:
        logging.getLogger("inflight").error("%s", notice)


def _gateway_settings(args, GatewaySettings, secret, password):  # noqa: N803 - the class, passed in
    """``inflight gateway``'s settings: the environment, then the flags. Raises ValueError."""
    return GatewaySettings.from_env(
        os.environ, redis_url=args.redis_url, model_path=args.model, rest_host=args.host,
        rest_port=args.rest_port, grpc_host=args.host, grpc_port=args.grpc_port, link_host=args.host,
        link_port=args.link_port, link_advertise=args.link_advertise or "", link_secret=secret,
        redis_password=password,
        **{k: v for k, v in (("router_mode", args.router_mode),
                             ("kv_overlap_score_weight", args.kv_overlap_score_weight),
                             ("router_temperature", args.router_temperature),
                             ("cache_threshold", args.cache_threshold)) if v is not None},
        **({"otlp_traces_endpoint": args.otlp_traces_endpoint} if args.otlp_traces_endpoint else {}))


def cmd_tokenizer(args) -> int:
    """``inflight tokenizer export DIR``: a transformers-style tokenizer folder of the
    served model, for aiperf, guidellm, ``vllm bench serve`` (bench/README.md)."""
    from common.model_files import resolve_model_path
    from common.tokenizer_export import export_tokenizer

    try:
        files = export_tokenizer(resolve_model_path(args.model), args.dir)
    except (OSError, ValueError) as exc:
        print(f"inflight tokenizer export: {exc}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    return 0


def _print_key(record, usage: dict) -> None:
    for name, value in sorted(vars(record).items()):
        print(f"{name:18} {value}")
    print(f"{'window usage':18} {usage['requests']} requests, {usage['tokens']} tokens in the last "
          f"60 s; {usage['in_flight']} in flight")


def _key_by_id(client, keys, args):
    if args.action == "show":
        return keys.get_key(client, args.key_id)
    return keys.set_limits(client, args.key_id, **_limits(args))


def _limits(args) -> dict:
    return {k: v for k, v in (("priority", args.priority), ("requests_per_min", args.rpm),
                              ("tokens_per_min", args.tpm), ("max_inflight", args.max_inflight),
                              ("max_max_tokens", args.max_tokens_cap),
                              ("max_prompt_tokens", args.max_prompt_tokens)) if v is not None}


def cmd_keys(args) -> int:
    import redis

    from gateway import keys
    from gateway.admission.ratelimit import window_usage

    if args.action in ("set", "show") and not args.key_id:
        print(f"inflight keys {args.action} needs a key id", file=sys.stderr)
        return 2
    try:
        password = _redis_password(args)
    except ValueError as exc:
        print(f"inflight keys: {exc}", file=sys.stderr)
        return 2
    from common.redis_connect import sync_client

    try:
        client = sync_client(args.redis_url, password)
    except ValueError as exc:
        print(f"inflight keys: {exc}", file=sys.stderr)
        return 2
    try:
        return _keys_action(args, client, keys, window_usage)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"inflight keys: Redis at {args.redis_url} is unreachable ({exc})", file=sys.stderr)
        return 1


def _keys_action(args, client, keys, window_usage) -> int:
    if args.action in ("set", "show"):
        record = _key_by_id(client, keys, args)
        if record is None:
            print(f"no such key: {args.key_id}", file=sys.stderr)
            return 1
        _print_key(record, window_usage(client, record.key_id))
    elif args.action == "create":
        limits = _limits(args)
        key_id, plaintext = keys.create_key(client, args.tenant, args.name or "", **limits)
        if not args.quiet:
            print(f"created {key_id} for tenant {args.tenant!r}; the key is shown once:")
        print(plaintext)
    elif args.action == "list":
        for record in keys.list_keys(client):
            state = "revoked" if record.revoked else "active"
            print(f"{record.key_id}  tenant={record.tenant}  name={record.name!r}  {state}")
    elif args.action == "revoke":
        if not keys.revoke_key(client, args.key_id):
            print(f"no such key: {args.key_id}", file=sys.stderr)
            return 1
        print(f"revoked {args.key_id}")
    return 0


def _stack_settings(args, run_dir: Path):
    """StackSettings for ``up``/``demo``. Raises ValueError (one line for the
    caller to print) when the worker's ``--kv-cache-dtype`` cannot run there, or
    its model is missing or unsupported."""
    from stack.stack import StackSettings

    _check_model(args.model)
    _check_dense_deterministic(args.dense_weights_min_rows, args.deterministic)
    if args.kv_cache_dtype != "auto" or args.quantization not in ("auto", "none") or args.dense_weights_min_rows:
        from worker.model.device import resolve_device

        device = resolve_device(args.device)
        _check_kv_cache_dtype(args.kv_cache_dtype, args.dtype, device)
        _check_quantization(args.quantization, args.dtype, device, args.model, args.dense_weights_min_rows)

    worker_args = ["--batching", args.batching, "--device", args.device, "--dtype", args.dtype,
                   "--kv-cache-dtype", args.kv_cache_dtype, "--quantization", args.quantization,
                   "--dense-weights-min-rows",
                   "auto" if args.dense_weights_min_rows is None else str(args.dense_weights_min_rows),
                   "--stream-interval", str(args.stream_interval)]
    if args.speculative_config:
        from worker.engine.engine_config import SpeculativeConfig

        SpeculativeConfig.from_json(args.speculative_config)  # a bad value fails here, in one line
        worker_args += ["--speculative-config", args.speculative_config]
    if args.deterministic:
        worker_args.append("--deterministic")
    settings = StackSettings(run_dir=run_dir, redis_url=args.redis_url, model=args.model,
                             use_nginx=not args.no_nginx, worker_args=tuple(worker_args),
                             log_format=args.log_format, tls=getattr(args, "tls", False))
    return settings.with_port_offset(args.port_offset) if args.port_offset else settings


def cmd_up(args) -> int:
    from stack.stack import Stack

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="inflight-up-"))
    try:
        stack = Stack(_stack_settings(args, run_dir))
        _check_chat_template(args.model)
    except ValueError as exc:
        print(f"inflight up: {exc}", file=sys.stderr)
        return 2
    print(f"starting inflight (logs in {run_dir}) …", flush=True)
    # SIGTERM stops the stack like Ctrl-C, from the first moment (start() cleans up after itself)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        stack.start()
    except KeyboardInterrupt:
        return 130
    try:
        key = stack.create_key(tenant="default", name="inflight up")
        ep = stack.endpoints()
        print(json.dumps({"endpoints": ep, "api_key": key}, indent=2))
        cacert = f"--cacert {ep['tls_ca']} " if "tls_ca" in ep else ""
        print(f"\ntry:\n  curl -N {cacert}{ep['rest']}/v1/chat/completions -H 'Authorization: Bearer {key}' "
              "-H 'Content-Type: application/json' -d '{\"messages\":[{\"role\":\"user\",\"content\":"
              "\"What is the capital of France?\"}],\"temperature\":0,\"stream\":true}'\n"
              f"more keys:\n  inflight keys create --tenant NAME --redis-url {ep['redis']}"
              + (f" --redis-password-file {ep['redis_password_file']}" if "redis_password_file" in ep else "")
              + "\n\nCtrl-C stops the stack.", flush=True)
        while True:
            time.sleep(1)
            for name in stack.supervise():
                print(f"{name} exited; started a new one (log: {run_dir / (name + '.log')})", flush=True)
    except KeyboardInterrupt:
        print("\nstopping …", flush=True)
    finally:
        stack.stop()
    return 0


def cmd_demo(args) -> int:
    from inflight.demo import demo

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="inflight-demo-"))
    try:
        settings = _stack_settings(args, run_dir)
    except ValueError as exc:
        print(f"inflight demo: {exc}", file=sys.stderr)
        return 2
    return demo(settings)


def _add_redis_password_arg(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--redis-password-file", default=None, metavar="PATH",
                   help=f"file holding the password of the Redis ACL user named in --redis-url (redis://{role}@host:6379/0; "
                        "default: $INFLIGHT_REDIS_PASSWORD_FILE, else the URL's password or none)")


def _add_link_secret_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--link-secret-file", default=None, metavar="PATH",
                   help="file holding the shared secret of the worker link (default: $INFLIGHT_LINK_SECRET_FILE, "
                        "else $INFLIGHT_LINK_SECRET; none: the gateway accepts any link and warns)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="inflight", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one object per line, with request_id where known")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, fn, helptext in (("up", cmd_up, "run the whole stack on this machine"),
                               ("demo", cmd_demo, "start the stack, send real prompts, stop")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--redis-url", default=None,
                       help="use this Redis, as it is, instead of an embedded one (a private redis-server with the "
                            "ACL users gateway, worker and admin, new passwords in <run dir>/redis-passwords)")
        p.add_argument("--model", default=None)
        p.add_argument("--run-dir", default=None, help="logs and sockets (default: a temp dir)")
        p.add_argument("--no-nginx", action="store_true", help="do not start the nginx edge")
        p.add_argument("--tls", action="store_true",
                       help="the edge speaks TLS (REST and gRPC) with a self-signed certificate made in the run dir "
                            "(printed as tls_ca: give it to clients as the trusted root)")
        p.add_argument("--batching", default="continuous", choices=["continuous", "static", "dynamic"])
        p.add_argument("--device", default="auto", type=device_spec, help="the worker's: auto, cpu, cuda or cuda:N")
        p.add_argument("--port-offset", type=int, default=0,
                       help="move every port by this much, for a second stack on one machine (e.g. 100: edge 8180)")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="the worker's KV cache element type (see `inflight worker --help`)")
        p.add_argument("--quantization", default="auto", choices=["auto", "none", "q8_0", "q4_1", "gguf"],
                       help="the worker's weight quantization (see `inflight worker --help`)")
        p.add_argument("--dense-weights-min-rows", type=auto_or_non_negative_int, default=None, metavar="ROWS",
                       help="the worker's dense bfloat16 weights for steps of many rows (see `inflight worker --help`)")
        p.add_argument("--stream-interval", type=positive_int, default=1,
                       help="the worker's tokens per streamed chunk (see `inflight worker --help`)")
        p.add_argument("--speculative-config", default="", metavar="JSON",
                       help="the worker's speculative decoding (see `inflight worker --help`)")
        p.add_argument("--deterministic", "--enable-deterministic-inference", action="store_true",
                       help="the worker's batch-invariant mode (see `inflight worker --help`)")
        p.set_defaults(fn=fn)

    p = sub.add_parser("worker", help="run one engine worker")
    p.add_argument("--redis-url", default=DEFAULT_REDIS)
    p.add_argument("--health-port", type=int, default=9100)
    p.add_argument("--health-host", default="127.0.0.1",
                   help="address of /health, /ready, /metrics and gRPC health (0.0.0.0 in containers)")
    p.add_argument("--grpc-health-port", type=int, default=9101,
                   help="grpc.health.v1 + reflection, SERVING once warmed up (0 = off)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--drain-grace-s", type=float, default=45.0,
                   help="after SIGTERM, seconds to finish running requests before handing the rest back")
    _add_worker_args(p)
    _add_link_secret_arg(p)
    _add_redis_password_arg(p, "worker")
    _add_tracing_arg(p)
    p.set_defaults(fn=cmd_worker)

    p = sub.add_parser("gateway", help="run the REST + gRPC gateway")
    p.add_argument("--redis-url", default=DEFAULT_REDIS)
    p.add_argument("--model", default=None, help="model whose tokenizer the gateway loads")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--rest-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--link-port", type=int, default=50052)
    p.add_argument("--link-advertise", default=None, help="host:port workers dial back")
    p.add_argument("--router-mode", default=None, choices=["kv", "shared"],
                   help="kv (default): queue each request on the own stream of the worker whose prefix cache "
                        "holds most of its prompt, load considered (NVIDIA Dynamo's --router-mode kv); shared: "
                        "routing off, every request on the shared stream")
    p.add_argument("--kv-overlap-score-weight", type=float, default=None,
                   help="weight of the prompt blocks a worker would prefill against its running sequences' blocks (default 2.0)")
    p.add_argument("--router-temperature", type=float, default=None,
                   help="0 (default): the lowest cost wins; > 0 samples workers by softmax of their costs")
    p.add_argument("--cache-threshold", type=float, default=None,
                   help="least fraction of the prompt's blocks the chosen worker must hold, else the shared "
                        "stream (SGLang router's --cache-threshold; default 0.5)")
    _add_link_secret_arg(p)
    _add_redis_password_arg(p, "gateway")
    _add_tracing_arg(p)
    p.set_defaults(fn=cmd_gateway)

    p = sub.add_parser("keys", help="create, list, show, set limits of or revoke API keys")
    p.add_argument("action", choices=["create", "list", "show", "set", "revoke"])
    p.add_argument("key_id", nargs="?", help="key id (show, set, revoke)")
    p.add_argument("--redis-url", default=DEFAULT_REDIS)
    p.add_argument("--tenant", default="default")
    p.add_argument("--name", default="")
    p.add_argument("--priority", type=int, default=None)
    p.add_argument("--rpm", type=non_negative_int, default=None, help="requests per minute")
    p.add_argument("--tpm", type=non_negative_int, default=None, help="tokens per minute")
    p.add_argument("--max-inflight", type=non_negative_int, default=None)
    p.add_argument("--max-tokens-cap", type=non_negative_int, default=None)
    p.add_argument("--max-prompt-tokens", type=non_negative_int, default=None)
    p.add_argument("--quiet", action="store_true", help="print only the key")
    _add_redis_password_arg(p, "admin")
    p.set_defaults(fn=cmd_keys)

    p = sub.add_parser("tokenizer", help="export the served model's tokenizer for benchmark clients")
    p.add_argument("action", choices=["export"])
    p.add_argument("dir", help="folder to write (tokenizer.json, tokenizer_config.json, ...)")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    p.set_defaults(fn=cmd_tokenizer)

    sub.add_parser("bench", help="benchmarks: `inflight bench --help` (see bench/README.md)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``inflight`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # argparse's REMAINDER drops leading --options: hand over as-is
        from bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.command == "keys" and args.action == "revoke" and not args.key_id:
        print("inflight keys revoke needs a key id", file=sys.stderr)
        return 2
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
