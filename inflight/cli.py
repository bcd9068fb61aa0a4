"""The ``inflight`` command: ``up``, ``demo``, ``worker``, ``gateway``, ``keys``, ``status``, ``tokenizer``, ``bench``.

Settings dataclasses are built here, once, from the arguments, and passed in.
"""

# The worker's options are declared in common/worker_options.py, turned into its settings and
# checked in worker/serve/options.py; this file dispatches.

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from common.cli_args import (ADMIN_REDIS_URL_OPTION, DEFAULT_REDIS_URL, LINK_SECRET_OPTION, TRACING_OPTION,
                             add_option, admin_redis_url, check_redis_url, link_secret_from, redis_password_from,
                             redis_password_option, unreachable_redis_hint)
from common.cli_types import non_negative_int, positive_int
from common.logs import configure_logging
from common.reasoning import REASONING_PARSERS
from common.worker_options import WorkerOptions, add_worker_options

#: The worker options ``up`` and ``demo`` take and pass on to their worker, in that order.
UP_WORKER_OPTIONS = ("batching", "device", "dtype", "kv_cache_dtype", "quantization", "dense_weights_min_rows",
                     "max_num_batched_tokens", "long_prefill_token_threshold", "stream_interval", "speculative_config", "deterministic", "disable_log_stats",
                     "enable_lora", "lora_modules", "max_loras", "max_lora_rank")
#: Worker options only ``up`` takes and passes on (``demo`` sends chat prompts: it needs a generating worker).
UP_ONLY_WORKER_OPTIONS = ("runner", "pooler_config")
#: Their help lines in ``up --help`` (the full ones are ``inflight worker --help``'s).
UP_HELP = {"device": {"help": "the worker's: auto, cpu, cuda or cuda:N"},
           "kv_cache_dtype": {"help": "the worker's KV cache element type (see `inflight worker --help`)"},
           "quantization": {"help": "the worker's weight quantization (see `inflight worker --help`)"},
           "dense_weights_min_rows": {"help": "the worker's dense bfloat16 weights for steps of many rows "
                                              "(see `inflight worker --help`)"},
           "max_num_batched_tokens": {"help": "the worker's per-step token budget (default 2048): a long prompt "
                                              "prefills in chunks of at most this many tokens (docs/BATCHING.md)"},
           "long_prefill_token_threshold": {"help": "the worker's most prompt tokens one request prefills per step, "
                                                    "so new requests start beside a long prompt's prefill (0 = off; "
                                                    "docs/BATCHING.md)"},
           "stream_interval": {"help": "the worker's tokens per streamed chunk (see `inflight worker --help`)"},
           "speculative_config": {"help": "the worker's speculative decoding (see `inflight worker --help`)"},
           "deterministic": {"help": "the worker's batch-invariant mode (see `inflight worker --help`)"},
           "runner": {"help": "the worker's: generate (default) or pooling (embeddings only: /v1/embeddings, "
                              "gRPC Embed; see `inflight worker --help`)"},
           "pooler_config": {"help": "with --runner pooling, the worker's pooling (see `inflight worker --help`)"}}

#: ``up``/``demo``'s nginx edge limits: flag, ``EdgeSettings`` field (stack/edge.py), type, help.
EDGE_OPTIONS = (("--ip-rate", "ip_rate", positive_int, "requests/s per client address at the nginx edge (default 10)"),
                ("--ip-burst", "ip_burst", non_negative_int,
                 "requests per client address over --ip-rate served at once before 429 (default 20)"),
                ("--key-rate", "key_rate", positive_int, "requests/s per presented API key at the edge (default 10)"),
                ("--key-burst", "key_burst", non_negative_int,
                 "requests per key over --key-rate served at once before 429 (default 20)"),
                ("--key-conns", "key_conns", positive_int, "open connections per API key at the edge (default 64)"))


def _edge_overrides(args) -> dict:
    """The ``EdgeSettings`` fields ``up``/``demo``'s edge flags set (those given)."""
    return {name: getattr(args, name) for _, name, _, _ in EDGE_OPTIONS if getattr(args, name, None) is not None}


def cmd_worker(args) -> int:
    from worker.model.gguf_check import ModelTooLarge
    from worker.serve.main import run_worker
    from worker.serve.options import checked_settings

    try:
        settings = checked_settings(WorkerOptions.from_args(args))
    except ValueError as exc:
        print(f"inflight worker: {exc}", file=sys.stderr)
        return 2
    try:
        return run_worker(settings)
    except ModelTooLarge as exc:  # known once the quantization is resolved, as the load starts
        print(f"inflight worker: {exc}", file=sys.stderr)
        return 2


def cmd_gateway(args) -> int:
    from gateway.main import run
    from gateway.settings import GatewaySettings

    try:
        secret, password = link_secret_from(args.link_secret_file), redis_password_from(args.redis_password_file)
    except ValueError as exc:
        print(f"inflight gateway: {exc}", file=sys.stderr)
        return 2
    # INFLIGHT_GATEWAY_<FIELD> variables set what has no flag (e.g. MAX_QUEUE_DEPTH); flags win.
    try:
        check_redis_url(args.redis_url)
        settings = _gateway_settings(args, GatewaySettings, secret, password)
        for spec in settings.model_specs():  # a broken template fails here, not at the first chat request
            if spec.task == "generate":
                _check_chat_template(spec.path)
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
        os.environ, redis_url=args.redis_url, rest_host=args.host,
        **({"models": tuple(args.model)} if args.model else {}),
        **({"models_file": args.models_file} if args.models_file else {}),
        rest_port=args.rest_port, grpc_host=args.host, grpc_port=args.grpc_port, link_host=args.host,
        link_port=args.link_port, link_advertise=args.link_advertise or "", link_secret=secret,
        redis_password=password,
        **{k: v for k, v in (("router_mode", args.router_mode),
                             ("kv_overlap_score_weight", args.kv_overlap_score_weight),
                             ("router_temperature", args.router_temperature),
                             ("cache_threshold", args.cache_threshold),
                             ("stream_idle_timeout_s", args.stream_idle_timeout),
                             ("stream_resume_ttl_s", args.stream_resume_ttl),
                             ("stream_owner_lease_s", args.stream_owner_lease),
                             ("link_keepalive_s", args.link_keepalive),
                             ("reasoning_parser", args.reasoning_parser)) if v is not None},
        **({"otlp_traces_endpoint": args.otlp_traces_endpoint} if args.otlp_traces_endpoint else {}))


def _cmd_status(args) -> int:
    from inflight.status import cmd_status

    return cmd_status(args)


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
    return keys.set_limits(client, args.key_id, model=args.model or "", models=_models(args), **_limits(args))


def _limits(args) -> dict:
    return {k: v for k, v in (("priority", args.priority), ("requests_per_min", args.rpm),
                              ("tokens_per_min", args.tpm), ("max_inflight", args.max_inflight),
                              ("max_max_tokens", args.max_tokens_cap),
                              ("max_prompt_tokens", args.max_prompt_tokens)) if v is not None}


def _models(args) -> tuple[str, ...] | None:
    """``--models a,b`` as a tuple (``--models ''``: every model again); None when not given."""
    if args.models is None:
        return None
    return tuple(name.strip() for name in args.models.split(",") if name.strip())


def cmd_keys(args) -> int:
    import redis

    from gateway import keys
    from gateway.admission.ratelimit import window_usage

    if args.action in ("set", "set-limits", "show") and not args.key_id:
        print(f"inflight keys {args.action} needs a key id", file=sys.stderr)
        return 2
    if args.model and args.action in ("set", "set-limits"):
        own_only = [flag for flag, value in (("--priority", args.priority), ("--max-tokens-cap", args.max_tokens_cap),
                                             ("--max-prompt-tokens", args.max_prompt_tokens)) if value is not None]
        if own_only:
            print(f"inflight keys set: {', '.join(own_only)} cannot be set per model; with --model M only "
                  "--rpm, --tpm and --max-inflight (set the key's own without --model)", file=sys.stderr)
            return 2
    try:
        password = redis_password_from(args.redis_password_file)
    except ValueError as exc:
        print(f"inflight keys: {exc}", file=sys.stderr)
        return 2
    from common.redis_connect import sync_client

    args.redis_url = admin_redis_url(args.redis_url, os.environ, "inflight keys")
    try:
        client = sync_client(args.redis_url, password)
    except ValueError as exc:
        print(f"inflight keys: {exc}", file=sys.stderr)
        return 2
    try:
        return _keys_action(args, client, keys, window_usage)
    except ValueError as exc:  # a limit gateway.keys refuses (it names it)
        print(f"inflight keys {args.action}: {exc}", file=sys.stderr)
        return 2
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"inflight keys: Redis at {args.redis_url} is unreachable ({exc}); {unreachable_redis_hint()}",
              file=sys.stderr)
        return 1
    except redis.RedisError as exc:  # NOPERM: a user other than admin (the gateway's, say)
        print(f"inflight keys: Redis at {args.redis_url} refused ({exc}); keys are managed as the Redis "
              "user admin (the redis URL and password file that inflight up printed)", file=sys.stderr)
        return 1


def _keys_action(args, client, keys, window_usage) -> int:
    if args.action in ("set", "set-limits", "show"):
        record = _key_by_id(client, keys, args)
        if record is None:
            print(f"no such key: {args.key_id}", file=sys.stderr)
            return 1
        _print_key(record, window_usage(client, record.key_id))
    elif args.action == "create":
        if args.model:
            print("inflight keys create: --model sets per-model limits of an existing key "
                  "(`inflight keys set KEY_ID --model M --rpm N`)", file=sys.stderr)
            return 2
        limits = _limits(args)
        key_id, plaintext = keys.create_key(client, args.tenant, args.name or "", admin=args.admin,
                                            models=_models(args) or (), **limits)
        if not args.quiet:
            print(f"created {key_id} for tenant {args.tenant!r}; the key is shown once:")
        print(plaintext)
    elif args.action == "list":
        for record in keys.list_keys(client):
            state = ("revoked" if record.revoked else "active") + (", admin" if record.admin else "")
            print(f"{record.key_id}  tenant={record.tenant}  name={record.name!r}  {state}")
    elif args.action == "revoke":
        if not keys.revoke_key(client, args.key_id):
            print(f"no such key: {args.key_id}", file=sys.stderr)
            return 1
        print(f"revoked {args.key_id}")
    return 0


#: How long ``up``/``demo`` wait for the stack, s: a first worker start may build the CPU kernels
#: (up to their 600 s limit on a busy machine, inflight_kernels/cpu/build.py) before it loads the model.
UP_READY_TIMEOUT_S = 900.0


def _stack_settings(args, run_dir: Path):
    """StackSettings for ``up``/``demo``. Raises ValueError (one line for the caller to
    print) when a worker option cannot run there, or its model is missing or unsupported
    (:func:`worker.serve.options.check_stack_options`)."""
    from stack.stack import StackSettings
    from worker.serve.options import check_stack_options

    options = WorkerOptions.from_args(args)
    check_stack_options(options)
    settings = StackSettings(run_dir=run_dir, redis_url=args.redis_url, model=args.model,
                             use_nginx=not args.no_nginx,
                             worker_args=tuple(options.to_argv(UP_WORKER_OPTIONS + UP_ONLY_WORKER_OPTIONS)),
                             edge_overrides=_edge_overrides(args),
                             log_format=args.log_format, tls=getattr(args, "tls", False),
                             ready_timeout_s=UP_READY_TIMEOUT_S)
    return settings.with_port_offset(args.port_offset) if args.port_offset else settings


def cmd_up(args) -> int:
    from stack.stack import Stack
    from stack.startup import default_steps

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="inflight-up-"))
    try:
        stack = Stack(_stack_settings(args, run_dir), default_steps())
        if args.runner != "pooling":  # an embeddings model needs no chat template
            _check_chat_template(args.model)
    except ValueError as exc:
        print(f"inflight up: {exc}", file=sys.stderr)
        return 2
    print(f"starting inflight (logs in {run_dir}) …", flush=True)
    # SIGTERM stops the stack like Ctrl-C, from the first moment (start() cleans up after itself);
    # and SIGINT does even when started as a background job of a non-interactive shell, which
    # starts it with SIGINT ignored (Python then leaves it ignored; `kill -INT` did nothing)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stack.start()
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:  # a process exited or never got ready: its log's tail says why
        print(f"inflight up: the stack did not start: {exc}", file=sys.stderr)
        return 1
    print(stack.steps.summary(), flush=True)
    try:
        key = stack.create_key(tenant="default", name="inflight up")
        admin_key = stack.create_key(tenant="default", name="inflight up (admin)", admin=True)
        ep = stack.endpoints()
        print(json.dumps({"endpoints": ep, "api_key": key, "admin_key": admin_key}, indent=2))
        cacert = f"--cacert {ep['tls_ca']} " if "tls_ca" in ep else ""
        if args.runner == "pooling":
            example = (f"curl {cacert}{ep['rest']}/v1/embeddings -H 'Authorization: Bearer {key}' "
                       "-H 'Content-Type: application/json' -d '{\"input\":[\"first text\",\"second text\"]}'")
        else:
            example = (f"curl -N {cacert}{ep['rest']}/v1/chat/completions -H 'Authorization: Bearer {key}' "
                       "-H 'Content-Type: application/json' -d '{\"messages\":[{\"role\":\"user\",\"content\":"
                       "\"What is the capital of France?\"}],\"temperature\":0,\"stream\":true}'")
        print(f"\ntry:\n  {example}\n"
              f"more keys:\n  inflight keys create --tenant NAME --redis-url {ep['redis']}"
              + (f" --redis-password-file {ep['redis_password_file']}" if "redis_password_file" in ep else "")
              + f"\nweb page (chat; the fleet tab takes the admin key):\n  {ep['rest']}/ui/"
              + f"\nthe fleet in this terminal:\n  inflight status --watch --redis-url {ep['redis']}"
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


class _OneModel(argparse.Action):
    """``up``/``demo``'s ``--model``: one model; a second ``--model`` is refused in one line
    (argparse would keep only the last, silently serving one of the two)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.exit(2, f"{parser.prog}: --model given twice: it serves one model; for several, run "
                           "'inflight gateway --model NAME=PATH --model NAME2=PATH2' and one 'inflight worker "
                           "--model PATH' per model (docs/MODELS.md, \"Several models behind one gateway\")\n")
        setattr(namespace, self.dest, values)


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
        add_worker_options(p, ["model"], {"model": {"help": None, "action": _OneModel}})
        p.add_argument("--run-dir", default=None, help="logs and sockets (default: a temp dir)")
        p.add_argument("--no-nginx", action="store_true", help="do not start the nginx edge")
        p.add_argument("--tls", action="store_true",
                       help="the edge speaks TLS (REST and gRPC) with a self-signed certificate made in the run dir "
                            "(printed as tls_ca: give it to clients as the trusted root)")
        for flag, dest, kind, helptext in EDGE_OPTIONS:
            p.add_argument(flag, dest=dest, type=kind, default=None, help=helptext)
        add_worker_options(p, ["batching", "device"], UP_HELP)
        p.add_argument("--port-offset", type=int, default=0,
                       help="move every port by this much, for a second stack on one machine (e.g. 100: edge 8180)")
        add_worker_options(p, UP_WORKER_OPTIONS[2:], UP_HELP)
        if name == "up":
            add_worker_options(p, UP_ONLY_WORKER_OPTIONS, UP_HELP)
        p.set_defaults(fn=fn)

    p = sub.add_parser("worker", help="run one engine worker")
    add_worker_options(p)
    p.set_defaults(fn=cmd_worker)

    p = sub.add_parser("gateway", help="run the REST + gRPC gateway")
    p.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    p.add_argument("--model", action="append", default=None, metavar="NAME=PATH",
                   help="a model served (its tokenizer and chat template are loaded here): NAME (the id clients "
                        "send, its workers' first --served-model-name) = PATH (GGUF file or HF folder), or PATH "
                        "alone (named like the worker names it); repeat for several models, the first is the "
                        "default (default: SmolLM2-135M-Instruct)")
    p.add_argument("--models-file", default=None, metavar="FILE",
                   help="a JSON (or YAML) list of models, [{\"name\": ..., \"path\": ..., \"task\": "
                        "\"generate\" | \"embed\"}], served after those of --model")
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
    p.add_argument("--stream-idle-timeout", type=float, default=None,
                   help="seconds a stream may go without its client taking a chunk before it is cancelled "
                        "and its KV freed (default 30)")
    p.add_argument("--link-keepalive", type=float, default=None,
                   help="seconds between pings on each worker link and the most one waits: a hung worker "
                        "(SIGSTOP) is declared lost within twice this and its requests continue elsewhere "
                        "(default 5)")
    p.add_argument("--stream-resume-ttl", type=int, default=None,
                   help="seconds a stream's journal stays in Redis after its last chunk, the window for a "
                        "resume with Last-Event-ID through any gateway (default 300)")
    p.add_argument("--stream-owner-lease", type=float, default=None,
                   help="seconds an open stream's owner lease lives without a refresh: a resume while it "
                        "lives relays the stream from its gateway; once it lapsed (that gateway died) the "
                        "resuming gateway continues the request (default 5)")
    p.add_argument("--cache-threshold", type=float, default=None,
                   help="least fraction of the prompt's blocks the chosen worker must hold, else the shared "
                        "stream (SGLang router's --cache-threshold; default 0.5)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="vLLM's flag: return a <think> model's thinking apart from its answer (chat: "
                        "reasoning_content; Responses: reasoning items); qwen3: the model opens the block, "
                        "deepseek_r1: the chat template does (default: off, text as written)")
    add_option(p, LINK_SECRET_OPTION)
    add_option(p, redis_password_option("gateway"))
    add_option(p, TRACING_OPTION)
    p.set_defaults(fn=cmd_gateway)

    p = sub.add_parser("keys", help="create, list, show, set limits of or revoke API keys")
    p.add_argument("action", choices=["create", "list", "show", "set", "set-limits", "revoke"],
                   help="set-limits is another name of set")
    p.add_argument("key_id", nargs="?", help="key id (show, set, revoke)")
    add_option(p, ADMIN_REDIS_URL_OPTION)
    p.add_argument("--tenant", default="default")
    p.add_argument("--name", default="")
    p.add_argument("--admin", action="store_true",
                   help="create: the key may also read the fleet view (GET /fleet, the web page's fleet tab)")
    p.add_argument("--priority", type=int, default=None, choices=(0, 1, 2),
                   help="priority class, 0 (highest) to 2 (docs/ADMISSION.md)")
    p.add_argument("--rpm", type=non_negative_int, default=None, help="requests per minute")
    p.add_argument("--tpm", type=non_negative_int, default=None, help="tokens per minute")
    p.add_argument("--max-inflight", type=non_negative_int, default=None)
    p.add_argument("--max-tokens-cap", type=non_negative_int, default=None)
    p.add_argument("--max-prompt-tokens", type=non_negative_int, default=None)
    p.add_argument("--models", default=None, metavar="A,B",
                   help="create, set: the models this key may use (served names, aliases, adapters), "
                        "comma-separated; others answer 404 model_not_found. '' = every model (the default)")
    p.add_argument("--model", default=None, metavar="M",
                   help="set: --rpm, --tpm and --max-inflight are this key's limits for model M, beside its "
                        "own (all 0 removes them)")
    p.add_argument("--quiet", action="store_true", help="print only the key")
    add_option(p, redis_password_option("admin"))
    p.set_defaults(fn=cmd_keys)

    p = sub.add_parser("status", help="the fleet: workers, models, running/waiting, KV cache, queues, tok/s, 429s")
    add_option(p, ADMIN_REDIS_URL_OPTION)
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="redraw every SECONDS (default 2) until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print JSON (the gateway's GET /fleet shape) instead")
    add_option(p, redis_password_option("admin"))
    p.set_defaults(fn=_cmd_status)

    p = sub.add_parser("tokenizer", help="export the served model's tokenizer for benchmark clients")
    p.add_argument("action", choices=["export"])
    p.add_argument("dir", help="folder to write (tokenizer.json, tokenizer_config.json, ...)")
    add_worker_options(p, ["model"])
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
