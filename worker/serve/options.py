"""From the command line's :class:`common.worker_options.WorkerOptions` to the worker's
:class:`~worker.serve.settings.WorkerSettings`, and the checks that refuse an unusable
option in one line before anything loads (the device, the KV cache and compute dtypes,
the quantization, the model and its file, the engine settings, the Redis URL).

Each check raises ValueError with the line to print; ``inflight worker`` runs them all
(:func:`checked_settings`), ``inflight up``/``demo`` the ones that need no worker process
(:func:`check_stack_options`) so a stack is not started with a worker that cannot run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from common.cli_args import check_redis_url, link_secret_from, redis_password_from
from common.worker_options import WorkerOptions
from worker.serve.settings import WorkerSettings

if TYPE_CHECKING:
    from worker.engine.engine_config import EngineConfig

#: Sequences per batch when ``--max-batch-size`` is not given, per batching mode.
DEFAULT_MAX_BATCH_SIZE = {"continuous": 64, "static": 8, "dynamic": 32}


def engine_config(o: WorkerOptions) -> EngineConfig:
    """The engine's configuration for ``o`` (batching, budgets, prefix cache, speculation, LoRA).

    Raises:
        ValueError: a setting out of range (``--max-num-batched-tokens 0``, say) or a bad
            ``--speculative-config``, in one line.
    """
    from worker.engine.engine_config import EngineConfig, SpeculativeConfig

    max_batch_size = o.max_batch_size or DEFAULT_MAX_BATCH_SIZE[o.batching]
    return EngineConfig(block_size=o.block_size, num_blocks=o.num_blocks, max_num_seqs=max_batch_size,
                        max_num_batched_tokens=o.max_num_batched_tokens,
                        long_prefill_token_threshold=o.long_prefill_token_threshold, batching=o.batching,
                        max_batch_size=None if o.batching == "continuous" else max_batch_size,
                        max_wait_ms=o.max_wait_ms, policy=o.policy,
                        enable_prefix_caching=not o.no_prefix_cache,
                        speculative=SpeculativeConfig.from_json(o.speculative_config),
                        enable_lora=o.enable_lora, max_loras=o.max_loras)


def to_settings(options: WorkerOptions) -> WorkerSettings:
    """The worker's settings for ``options`` (its device as given, unresolved); reads the
    link secret and Redis password files.

    Raises:
        ValueError: an engine setting out of range (:class:`~worker.engine.engine_config.EngineConfig`),
            a bad ``--speculative-config``, or an unreadable or empty credentials file.
    """
    from worker.engine.pooler import PoolerConfig

    o = options
    check_runner(o)
    engine = engine_config(o)
    kw = dict(redis_url=o.redis_url, model=o.model, served_model_name=tuple(o.served_model_name or ()),
              device=o.device, dtype=o.dtype,
              kv_cache_dtype=o.kv_cache_dtype, quantization=o.quantization,
              dense_weights_min_rows=o.dense_weights_min_rows, engine=engine,
              threads=o.threads, adaptive_threads=not o.no_adaptive_threads,
              deterministic=o.deterministic,
              kv_cache_bytes=None if o.kv_cache_mib is None else o.kv_cache_mib * 1024 * 1024,
              health_port=o.health_port, health_host=o.health_host,
              grpc_health_port=o.grpc_health_port, warmup_tokens=o.warmup_tokens,
              stream_interval=o.stream_interval, drain_grace_s=o.drain_grace_s,
              otlp_traces_endpoint=o.otlp_traces_endpoint or "", kv_events=not o.no_kv_events,
              log_stats=not o.disable_log_stats, runner=o.runner,
              pooler_config=PoolerConfig.from_json(o.pooler_config),
              lora_modules=lora_modules(o), max_lora_rank=o.max_lora_rank)
    if o.worker_id:
        kw["worker_id"] = o.worker_id
    kw["link_secret"] = link_secret_from(o.link_secret_file)
    kw["redis_password"] = redis_password_from(o.redis_password_file)
    return WorkerSettings(**kw)


def checked_settings(options: WorkerOptions) -> WorkerSettings:
    """Every check of ``inflight worker``, in the order a user meets them, then the settings
    with the device resolved (``auto`` -> ``cpu``, ``cuda:0``).

    Raises:
        ValueError: the first unusable option, in one line.
    """
    from worker.model.device import resolve_device

    o = options
    device = resolve_device(o.device)  # an unusable --device fails here, in one line, before anything starts
    check_kv_cache_dtype(o.kv_cache_dtype, o.dtype, device)  # and so does an unusable cache dtype
    # dense copies with --deterministic: a conflict of the flags whatever the CPU, so said first
    check_dense_deterministic(o.dense_weights_min_rows, o.deterministic)
    check_quantization(o.quantization, o.dtype, device, o.model, o.dense_weights_min_rows)
    settings = to_settings(o)  # and an engine setting out of range
    check_redis_url(o.redis_url)  # and a malformed redis+sentinel:// URL
    check_model(o.model)  # and a missing model, an unsupported architecture, quantization or RoPE type
    return dataclasses.replace(settings, device=str(device))


def check_stack_options(options: WorkerOptions) -> None:
    """The checks ``inflight up``/``demo`` run before starting a stack: the model, the
    dense-copies conflict, and, where one is not ``auto``, the KV cache dtype and the
    quantization on the resolved device; the engine's settings (:func:`engine_config`); the ``--lora-modules``
    checks of :func:`lora_modules`.

    Raises:
        ValueError: the first unusable option, in one line.
    """
    o = options
    check_model(o.model)
    check_dense_deterministic(o.dense_weights_min_rows, o.deterministic)
    if o.kv_cache_dtype != "auto" or o.quantization not in ("auto", "none") or o.dense_weights_min_rows:
        from worker.model.device import resolve_device

        device = resolve_device(o.device)
        check_kv_cache_dtype(o.kv_cache_dtype, o.dtype, device)
        check_quantization(o.quantization, o.dtype, device, o.model, o.dense_weights_min_rows)
    engine_config(o)  # --max-num-batched-tokens 0, a bad --speculative-config ...: one line, before Redis starts
    lora_modules(o)  # --lora-modules without --enable-lora, a name twice, no adapter files, a rank too high
    check_runner(o)  # likewise


def lora_modules(options: WorkerOptions) -> tuple[tuple[str, str], ...]:
    """``--lora-modules`` as ``(name, path)`` pairs, checked without the model's weights:
    ``--enable-lora`` given, each name once, each path a PEFT adapter directory whose rank is
    within ``--max-lora-rank`` (:func:`worker.model.lora.check_adapter_config`) and whose base
    model is not clearly another than ``--model``'s (:func:`worker.model.lora_base.check_base_model`,
    the model's header or config read only when an adapter names a base); target modules and
    shapes are checked against the model when it loads.

    Raises:
        ValueError: the first problem, in one line.
    """
    specs = list(options.lora_modules or ())
    if specs and not options.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    pairs = [tuple(spec.split("=", 1)) for spec in specs]
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    from worker.model.lora import check_adapter_config, read_adapter_config
    from worker.model.lora_base import check_base_model

    identity = None
    for name, path in pairs:
        try:
            config = read_adapter_config(path)
        except FileNotFoundError as exc:
            raise ValueError(f"--lora-modules {name}={path}: {exc}") from exc
        check_adapter_config(config, options.max_lora_rank, f"--lora-modules {name}={path}")
        if config.get("base_model_name_or_path") and identity is None:
            identity = _model_identity(options)
        check_base_model(config, identity, f"--lora-modules {name}={path}")
    return tuple(pairs)


def _model_identity(options: WorkerOptions):
    """:func:`worker.model.lora_base.model_identity` of ``--model`` served as the options say;
    labels only when the model path does not resolve (its own check says why)."""
    from common.model_files import resolve_model_path
    from worker.model.lora_base import ModelIdentity, model_identity
    from common.served_model import default_served_name

    served = tuple(options.served_model_name or ()) or (default_served_name(options.model),)
    try:
        path = resolve_model_path(options.model)
    except (OSError, ValueError):
        return ModelIdentity((), served)
    return model_identity(path, served)


def check_runner(options: WorkerOptions) -> None:
    """Raise ValueError now for ``--pooler-config`` or ``--enable-lora`` with the other
    ``--runner``, or a ``--pooler-config`` that does not parse
    (:meth:`worker.engine.pooler.PoolerConfig.from_json`)."""
    from worker.engine.pooler import PoolerConfig

    if options.pooler_config and options.runner != "pooling":
        raise ValueError("--pooler-config applies to --runner pooling only")
    if options.enable_lora and options.runner == "pooling":
        raise ValueError("--enable-lora applies to --runner generate only (a pooling worker serves no adapters)")
    PoolerConfig.from_json(options.pooler_config)


def check_model(model: str | None) -> None:
    """Raise ValueError now, before anything starts, when the model is missing or its
    architecture, a GGUF tensor's type or its RoPE type is unsupported (read from the
    config or the GGUF header: :func:`worker.model.loader.check_model`)."""
    from common.model_files import resolve_model_path
    from worker.model.loader import check_model as check_model_files

    try:
        check_model_files(resolve_model_path(model))
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: str, device) -> None:
    """Raise ValueError now, before the weights load, when ``--kv-cache-dtype``
    cannot be used with ``--dtype`` on ``device`` (a ``torch.device``; see
    :func:`worker.model.dtype.resolve_kv_cache_dtype`); "auto" always can."""
    if kv_cache_dtype == "auto":
        return
    from worker.model.dtype import resolve_dtype, resolve_kv_cache_dtype

    resolve_kv_cache_dtype(kv_cache_dtype, resolve_dtype(dtype, device, 0, 0), device, 0)


def check_dense_deterministic(dense_min_rows: int | None, deterministic: bool) -> None:
    """Raise ValueError now, before the weights load, for ``--dense-weights-min-rows N`` (N > 0)
    with ``--deterministic``, which refuses what makes a row's result depend on its batch
    (:func:`worker.model.determinism.batch_invariance_problems`; ``auto`` is off there)."""
    if deterministic and dense_min_rows:
        raise ValueError(f"--dense-weights-min-rows {dense_min_rows} makes a row's result depend on how many rows "
                         "share its step, which --deterministic refuses: leave it at auto or 0")


def check_quantization(quantization: str, dtype: str, device, model: str | None,
                       dense_min_rows: int | None = 0) -> None:
    """Raise ValueError now, before the weights load, when ``--quantization``
    cannot run with ``--dtype`` on ``device`` for ``model``
    (:func:`worker.model.quantization.resolve_quantization`, :func:`~worker.model.quantization.compute_dtype`),
    or ``--dense-weights-min-rows`` has no blocks to copy (:func:`~worker.model.dense_weights.check_dense_min_rows`)."""
    if quantization not in ("auto", "none") or dense_min_rows:  # None (auto) and 0 need no check
        from common.model_files import resolve_model_path
        from worker.model import dense_weights, quantization as q
        from worker.model.gguf_check import check_gguf_file

        try:
            path = resolve_model_path(model)
        except FileNotFoundError:
            return  # check_model says so
        if path.suffix == ".gguf":
            check_gguf_file(path)  # a truncated or corrupt file in one line, before GGUFReader maps it
        resolved = q.resolve_quantization(quantization, path, dtype, device)
        q.compute_dtype(resolved, dtype, device)
        if dense_min_rows:
            dense_weights.check_dense_min_rows(dense_min_rows, resolved, resolved == "gguf" and q.gguf_bf16_activations(dtype))
