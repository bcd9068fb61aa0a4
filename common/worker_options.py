"""The options of ``inflight worker``, each declared once: its flag, default, type and help.

:class:`WorkerOptions` is the one place a worker flag is spelt. ``inflight worker`` adds all of
them (:func:`add_worker_options`); ``inflight up``/``demo`` and ``inflight bench`` add the ones
they pass on, with their own help line where it differs, and start the worker with
:meth:`WorkerOptions.to_argv`. Turning the options into
:class:`worker.serve.settings.WorkerSettings`, and checking them against the device and the
model before anything loads, is the worker's (worker/serve/options.py).

It lives in ``common/`` (no torch, no worker import) because ``inflight gateway`` builds the
same parser in the gateway image, which has no worker package.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from common.cli_args import DEFAULT_REDIS_URL, LINK_SECRET_OPTION, TRACING_OPTION, OptionSpec, redis_password_option
from common.cli_types import auto_or_non_negative_int, device_spec, positive_int

DTYPES = ["auto", "float32", "bfloat16", "float16"]
QUANTIZATIONS = ["auto", "none", "q8_0", "q4_1", "gguf"]
BATCHING_MODES = ["continuous", "static", "dynamic"]
RUNNERS = ["generate", "pooling"]
POOLER_CONFIG_HELP = ("with --runner pooling, vLLM's JSON form: '{\"pooling_type\": \"LAST\", \"normalize\": true}' "
                      "(pooling_type LAST: the last token's final hidden state, as Qwen3-Embedding; MEAN: the "
                      "average over the input's tokens; CLS: the first token's; normalize: L2-normalize the "
                      "vector). Default: LAST, normalized")

DETERMINISTIC_HELP = ("batch-invariant mode (SGLang's --enable-deterministic-inference): start only where every "
                      "op of the step gives a row the same bits whatever else is in the batch (compiled CPU "
                      "kernels; prepacked float32/bfloat16 or q8_0 projections; not CUDA), and keep the thread "
                      "count fixed; a request's greedy text and logprobs then do not depend on other traffic")
SPEC_CONFIG_HELP = ("speculative decoding, vLLM's JSON form: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                    "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": 4}' (draft tokens "
                    "by prompt lookup, verified in one forward pass; greedy output unchanged, sampled output "
                    "distributed as without it). Default: off")


def lora_module(text: str) -> str:
    """One ``--lora-modules`` value, ``name=path`` (vLLM's form; the path a PEFT adapter
    directory), as given.

    Raises:
        argparse.ArgumentTypeError: no ``=``, or an empty name or path.
    """
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path (a PEFT adapter directory), got {text!r}")
    return text


def _opt(default: Any, *flags: str, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a command-line option: ``flags`` and ``argparse_kwargs``
    for ``add_argument``, the field's ``default`` as the option's default."""
    return field(default=default, metadata={"option": (flags, argparse_kwargs)})


def _declared(default: Any, spec: OptionSpec) -> Any:
    """A dataclass field for an option declared in common/cli_args.py (shared with the gateway)."""
    flags, kwargs = spec
    kwargs = {k: v for k, v in kwargs.items() if k != "default"}
    return field(default=default, metadata={"option": (flags, kwargs)})


@dataclass(frozen=True)
class WorkerOptions:
    """Every ``inflight worker`` option, as parsed (field names are argparse's ``dest``; the
    negative flags ``--no-*`` stay negative here). Field order is the order of
    ``inflight worker --help``. Each field's metadata holds its flag and argparse arguments;
    the help text says its meaning and unit."""

    redis_url: str = _opt(DEFAULT_REDIS_URL, "--redis-url")
    health_port: int = _opt(9100, "--health-port", type=int)
    health_host: str = _opt("127.0.0.1", "--health-host",
                            help="address of /health, /ready, /metrics and gRPC health (0.0.0.0 in containers)")
    grpc_health_port: int = _opt(9101, "--grpc-health-port", type=int,
                                 help="grpc.health.v1 + reflection, SERVING once warmed up (0 = off)")
    worker_id: str | None = _opt(None, "--worker-id")
    drain_grace_s: float = _opt(45.0, "--drain-grace-s", type=float,
                                help="after SIGTERM, seconds to finish running requests before handing the rest back")
    model: str | None = _opt(None, "--model", help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    served_model_name: tuple[str, ...] = _opt(
        (), "--served-model-name", nargs="+", type=str, metavar="NAME",
        help="the names clients send in 'model' (vLLM's flag): the first is the model's id, which names its "
             "request streams and must match the gateway's --model NAME; the others are aliases "
             "(default: SmolLM2-135M-Instruct for the default model, else the file's name without .gguf "
             "or the folder's name)")
    device: str = _opt("auto", "--device", type=device_spec,
                       help="auto (a CUDA GPU when torch sees one and CuPy is installed, else the CPU), cpu, cuda "
                            "or cuda:N")
    dtype: str = _opt("auto", "--dtype", choices=DTYPES)
    kv_cache_dtype: str = _opt(
        "auto", "--kv-cache-dtype", choices=DTYPES,
        help="KV cache element type (default auto: the compute dtype; float16 for float32 compute on "
             "a CPU with the compiled attention kernel, as llama.cpp's default f16 cache; bfloat16 "
             "with --quantization q8_0, or gguf with bfloat16 activations, where that kernel has the "
             "AVX-512 BF16 path)")
    quantization: str = _opt(
        "auto", "--quantization", choices=QUANTIZATIONS,
        help="gguf: a GGUF file's Q4_1 and Q8_0 tensors keep their blocks and run weight-only "
             "(float32 activations, the weights dequantized in registers), as vLLM's gguf; "
             "q8_0: int8 weights and activations, one scale per 32 values (llama.cpp's Q8_0), a quarter "
             "of the float32 weight bytes; q4_1: 4-bit projections with a scale and a minimum per 32 "
             "values (llama.cpp's Q4_1, the default GGUF's own blocks) and a Q8_0 lm_head, int8 "
             "activations; all three CPU and float32 only; none keeps the float weights; auto "
             "(default): gguf for a GGUF file whose projections are all Q4_1 or Q8_0, on the CPU "
             "with --dtype auto or float32, else none")
    dense_weights_min_rows: int | None = _opt(
        None, "--dense-weights-min-rows", type=auto_or_non_negative_int, metavar="ROWS",
        help="with a GGUF file's blocks: steps of at least ROWS rows multiply in dense products, faster "
             "once a step is bound by arithmetic: Q4_1/Q8_0 blocks through bfloat16 copies of the weights "
             "(bfloat16 activations: a CPU with AVX-512 BF16; on oneDNN's AMX tiles where the CPU has "
             "them) at 2 bytes per weight more memory, K-quant blocks through tiles dequantized in "
             "cache per product (no memory: bfloat16 on AVX-512 BF16, float32 on AVX2 CPUs); results "
             "then depend on the step's row count, so --deterministic refuses a count; 0: off; auto "
             "(default): 16 where the blocks take bfloat16 activations (8 for a file whose blocks are "
             "all K-quants), 32 for K-quants on AVX2 CPUs, the copies off when they would take over a "
             "quarter of the memory left after loading, and off with --deterministic")
    threads: int | None = _opt(None, "--threads", type=positive_int,
                               help="CPU threads for the model (default: the smaller of the CPUs in the affinity "
                                    "mask and the cgroup CPU quota, rounded down; the log says which)")
    no_adaptive_threads: bool = _opt(
        False, "--no-adaptive-threads", action="store_true",
        help="keep the thread count fixed; by default a CPU worker without --threads gives a thread "
             "up while other processes take CPUs of its affinity mask, and takes it back when they stop")
    deterministic: bool = _opt(False, "--deterministic", "--enable-deterministic-inference", action="store_true",
                               help=DETERMINISTIC_HELP)
    batching: str = _opt("continuous", "--batching", choices=BATCHING_MODES)
    max_batch_size: int | None = _opt(None, "--max-batch-size", type=int,
                                      help="sequences per batch (default: 64 continuous, 8 static, 32 dynamic)")
    max_wait_ms: float = _opt(5.0, "--max-wait-ms", type=float, help="dynamic batching wait (ms)")
    max_num_batched_tokens: int = _opt(2048, "--max-num-batched-tokens", type=int, help="per-step token budget")
    long_prefill_token_threshold: int = _opt(
        0, "--long-prefill-token-threshold", type=int, metavar="N",
        help="most prompt tokens one request prefills per step, so shorter prompts are admitted "
             "beside a long one's prefill instead of waiting for all of it (0 = off, as vLLM's)")
    block_size: int = _opt(16, "--block-size", type=int)
    num_blocks: int | None = _opt(None, "--num-blocks", type=int)
    kv_cache_mib: int | None = _opt(
        None, "--kv-cache-mib", type=int,
        help="KV cache size (default: 512 MiB on the CPU, 90%% of the GPU memory left after the weights)")
    policy: str = _opt("fcfs", "--policy", choices=["fcfs", "sjf", "fair"],
                       help="waiting-queue order (priority 0 always first)")
    no_prefix_cache: bool = _opt(False, "--no-prefix-cache", action="store_true", help="turn prefix caching off")
    no_kv_events: bool = _opt(
        False, "--no-kv-events", action="store_true",
        help="do not publish the prefix cache's block hashes and the load to Redis (the gateway's "
             "KV-aware router then never picks this worker; it serves the shared streams)")
    disable_log_stats: bool = _opt(
        False, "--disable-log-stats", action="store_true",
        help="do not log throughput, running/waiting sequences and KV-cache use every 10 s (vLLM's flag)")
    stream_interval: int = _opt(
        1, "--stream-interval", type=positive_int,
        help="tokens per streamed chunk after the first (default 1: every token at once; larger "
             "values send fewer, bigger chunks, as SGLang's and vLLM's --stream-interval)")
    speculative_config: str = _opt("", "--speculative-config", metavar="JSON", help=SPEC_CONFIG_HELP)
    runner: str = _opt("generate", "--runner", choices=RUNNERS,
                       help="generate (default): completions and chat; pooling: embeddings only "
                            "(/v1/embeddings, gRPC Embed), the prompt's pooled hidden state, never generating "
                            "(vLLM's --runner); each kind of worker refuses the other's requests")
    pooler_config: str = _opt("", "--pooler-config", metavar="JSON", help=POOLER_CONFIG_HELP)
    enable_lora: bool = _opt(False, "--enable-lora", action="store_true",
                             help="serve LoRA adapters (vLLM's flag): requests whose 'model' names one run in the "
                                  "same continuous batch as the base model's and other adapters'")
    lora_modules: list[str] | None = _opt(
        None, "--lora-modules", nargs="+", action="extend", type=lora_module, metavar="NAME=PATH",
        help="LoRA adapters served from the start, each NAME=PATH with PATH a PEFT adapter directory "
             "(adapter_config.json + adapter_model.safetensors); repeatable; needs --enable-lora. More are "
             "loaded and unloaded at run time through the gateway's /v1/load_lora_adapter")
    max_loras: int = _opt(1, "--max-loras", type=positive_int,
                          help="most LoRA adapters loaded at once, hence in one step (vLLM's flag, default 1): "
                               "loading another evicts the least recently used one no running request uses; "
                               "evicted adapters stay served and are loaded again when a request names them")
    max_lora_rank: int = _opt(16, "--max-lora-rank", type=positive_int,
                              help="highest LoRA rank r accepted (vLLM's flag, default 16); an adapter above it "
                                   "is refused at load")
    warmup_tokens: int = _opt(256, "--warmup-tokens", type=int,
                              help="prompt length of the warm-up forward pass run before reporting ready")
    link_secret_file: str | None = _declared(None, LINK_SECRET_OPTION)
    redis_password_file: str | None = _declared(None, redis_password_option("worker"))
    otlp_traces_endpoint: str | None = _declared(None, TRACING_OPTION)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerOptions:
        """The options of a parsed command line; those its parser did not add keep their defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def to_argv(self, names: tuple[str, ...] | list[str]) -> list[str]:
        """The ``inflight worker`` arguments that pass the options ``names`` on (each named one
        whatever its value, so the worker's log shows it): a flag and its value; a true
        ``store_true`` option as its flag alone, a false one not at all; an empty or None value
        not at all, except ``--dense-weights-min-rows`` None, which is ``auto``.

        Raises:
            KeyError: a name that is not an option.
        """
        specs = option_specs()
        argv: list[str] = []
        for name in names:
            (flag, *_), kwargs = specs[name]
            value = getattr(self, name)
            if kwargs.get("action") == "store_true":
                argv += [flag] if value else []
            elif value is None and kwargs.get("type") is auto_or_non_negative_int:
                argv += [flag, "auto"]
            elif isinstance(value, (tuple, list)):
                argv += [flag, *map(str, value)] if value else []
            elif value is not None and value != "":
                argv += [flag, str(value)]
        return argv

    def replace(self, **changes: Any) -> WorkerOptions:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def option_specs() -> dict[str, OptionSpec]:
    """Each option's field name -> (flags, argparse keyword arguments with the field's default)."""
    out = {}
    for f in fields(WorkerOptions):
        flags, kwargs = f.metadata["option"]
        out[f.name] = (flags, {"default": f.default, **kwargs})
    return out


def add_worker_options(parser: argparse.ArgumentParser, names: tuple[str, ...] | list[str] | None = None,
                       overrides: dict[str, dict[str, Any]] | None = None) -> None:
    """Add the options ``names`` (None: all, in ``inflight worker``'s order) to ``parser``,
    in the order given; ``overrides`` maps a name to argparse arguments that replace the
    declared ones (another command's help line, ``help=None`` for none, or its own default).

    Raises:
        KeyError: a name that is not an option.
    """
    specs = option_specs()
    for name in (names if names is not None else list(specs)):
        flags, kwargs = specs[name]
        merged = {**kwargs, **(overrides or {}).get(name, {})}
        parser.add_argument(*flags, **{k: v for k, v in merged.items() if not (k == "help" and v is None)})
