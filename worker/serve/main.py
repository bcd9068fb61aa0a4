"""Worker process entry point: load the model, warm up, register, serve.

Readiness (``/ready`` 200, gRPC health SERVING and the Redis heartbeat) starts
only after the weights are loaded and a warm-up forward pass of ``warmup_tokens``
ran. SIGTERM/SIGINT end readiness, stop pulling, let running requests finish, then exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import time

import redis.asyncio as aioredis
import torch
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis import exceptions as redis_errors

from common.model_files import resolve_model_path
from common.progress import Progress
from common.redis_keys import heartbeat_key
from common.served_model import Announcement, runner_task
from common.tokenizer_fingerprint import tokenizer_fingerprint
from common.redis_connect import async_client
from common.tokenizer import load_tokenizer
from common.tracing import configure as configure_tracing
from worker.model.device import describe, resolve_device
from worker.engine.engine import LLMEngine
from worker.engine.pooling_engine import PoolingEngine
from worker.serve.cpu_threads import choose_threads
from worker.serve.thread_governor import ThreadGovernor
from worker.serve.engine_thread import EngineThread
from worker.serve.health_grpc import start_grpc_health_server
from worker.serve.health_http import HealthState, start_health_server
from worker.serve.metrics import WorkerMetrics
from worker.model.determinism import require_batch_invariance
from worker.model.lora_base import model_identity
from worker.model.model_runner import load_model_runner
from worker.serve.lora_sync import LoraSync, stop_sync
from worker.serve.service import WorkerService
from worker.serve.settings import WorkerSettings

log = logging.getLogger(__name__)


def _dense_min_rows(settings: WorkerSettings) -> int | None:
    """``--dense-weights-min-rows``, with ``auto`` off under ``--deterministic`` (the copies make a
    row's result depend on its step's row count; an explicit count is refused there instead)."""
    if settings.dense_weights_min_rows is None and settings.deterministic:
        return 0
    return settings.dense_weights_min_rows


def build_engine(settings: WorkerSettings) -> tuple[LLMEngine | PoolingEngine, str]:
    """Load weights and tokenizer and build the engine; returns (engine, the model's id: the
    first ``--served-model-name``)."""
    path = resolve_model_path(settings.model)
    tokenizer = load_tokenizer(path)
    device = resolve_device(settings.device)
    log.info("device %s (asked for %s)", describe(device), settings.device)
    engine = settings.engine
    runner = load_model_runner(path, dtype=settings.dtype, device=device, block_size=engine.block_size,
                               num_blocks=engine.num_blocks, kv_cache_bytes=settings.kv_cache_bytes,
                               kv_cache_dtype=settings.kv_cache_dtype, quantization=settings.quantization,
                               dense_min_rows=_dense_min_rows(settings))
    if settings.deterministic:
        require_batch_invariance(runner)
        log.info("--deterministic: every op of the step is batch-invariant on this device")
    config = dataclasses.replace(engine, num_blocks=runner.num_blocks, enable_kv_events=settings.kv_events)
    runner.max_lora_rank = settings.max_lora_rank
    runner.model_identity = model_identity(path, settings.served_names)  # an adapter's base model is compared with it
    if settings.runner == "pooling":  # embeddings only: prefill, pool, never generate
        pooler = settings.pooler_config
        log.info("--runner pooling: %s pooling%s", pooler.pooling_type, ", normalized" if pooler.normalize else "")
        return PoolingEngine(runner, tokenizer, config, pooler), settings.model_id
    llm = LLMEngine(runner, tokenizer, config)
    for name, lora_path in settings.lora_modules:  # a refused adapter stops the start, naming why
        llm.add_lora(name, lora_path)
        log.info("LoRA adapter %s loaded from %s", name, lora_path)
    llm.grammars.compiler.prepare()  # structured outputs' tokenizer, on a compile thread during the warm-up
    return llm, settings.model_id


async def _first_lora_sync(sync: LoraSync) -> None:
    """Apply the LoRA operations already in Redis once, before the worker is ready; Redis
    failing here is logged and left to the periodic sync."""
    try:
        if ran := await sync.tick():
            log.info("%d LoRA adapter operation(s) loaded at run time applied before serving", ran)
    except (redis_errors.RedisError, OSError) as exc:
        log.warning("LoRA adapter sync at start failed (%s); the periodic sync retries", exc)


def metrics_url(settings: WorkerSettings) -> str:
    """Where this worker's /metrics answers, for the fleet view; "" when the health server is
    off. A wildcard listen address is named by this host's name."""
    if not settings.health_port:
        return ""
    host = settings.health_host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.health_port}/metrics"


def announcement(settings: WorkerSettings, engine: LLMEngine, started: float, fingerprint: str) -> Announcement:
    """What this worker serves, as its heartbeat says it (common/served_model.py): its served
    names, context length (tokens), tokenizer ``fingerprint`` (:func:`tokenizer_fingerprint`),
    task (``--runner pooling``: embed) and the LoRA adapters loaded now (``engine.lora_names()``
    where the engine has it); ``started``: Unix seconds."""
    lora_names = getattr(engine, "lora_names", None)
    return Announcement(worker_id=settings.worker_id, served_model_names=settings.served_names,
                        max_model_len=int(engine.max_model_len), tokenizer_fingerprint=fingerprint,
                        task=runner_task(getattr(settings, "runner", "generate")),
                        adapters=tuple(lora_names()) if lora_names is not None else (),
                        batching=settings.engine.batching, started=started, metrics_url=metrics_url(settings))


async def _heartbeat(redis: aioredis.Redis, settings: WorkerSettings, engine: LLMEngine,
                     state: HealthState) -> None:
    """Keep ``inflight:workers:{id}`` (TTL ``heartbeat_ttl_s``) while ready and not draining,
    its value re-read each beat (the adapters loaded change at run time)."""
    key = heartbeat_key(settings.worker_id)
    started = time.time()
    fingerprint = tokenizer_fingerprint(engine.tokenizer)  # once: the tokenizer never changes
    while True:
        try:
            if state.ready and not state.draining:
                value = announcement(settings, engine, started, fingerprint).to_json()
                await redis.set(key, value, ex=settings.heartbeat_ttl_s)
            else:
                await redis.delete(key)
        except Exception as exc:  # noqa: BLE001 - Redis may be restarting; keep trying
            log.warning("heartbeat failed: %s", exc)
        await asyncio.sleep(settings.heartbeat_s)


def redis_client(url: str, password: str | None = None) -> aioredis.Redis:
    """The worker's asyncio Redis client: 5 s timeouts, and one immediate retry on a fresh
    connection, so an XACK or XREADGROUP right after a Redis restart does not fail on a pooled
    connection the restart closed (a failed XACK leaves the entry pending: redelivered later).
    A timeout is not retried: it would only double the wait on a Redis that hangs. A
    ``redis+sentinel://`` URL gives the master Sentinel names, found again after a failover
    (common/redis_connect.py).

    Raises:
        ValueError: a malformed ``redis+sentinel://`` URL."""
    return async_client(url, password, socket_timeout=5, socket_connect_timeout=5,
                        retry=Retry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,)))


async def serve(settings: WorkerSettings) -> None:
    """Run the worker until SIGTERM/SIGINT. Raises OSError when a health port is taken."""
    state = HealthState()
    grpc_health = None
    if settings.grpc_health_port:  # up first: probes get NOT_SERVING during the model load
        grpc_health = start_grpc_health_server(settings.health_host, settings.grpc_health_port)
        state.on_change(grpc_health.set_serving)
    try:
        await _load_and_run(settings, state)
    finally:
        if grpc_health is not None:
            grpc_health.stop()


def _thread_governor(settings: WorkerSettings, threads: int, device: torch.device) -> ThreadGovernor | None:
    """The governor of the model's CPU threads (worker/serve/thread_governor.py), or None
    when ``--threads`` fixed them, ``--no-adaptive-threads`` or ``--deterministic`` turned it
    off (oneDNN may split a GEMM's sum differently with another thread count), or the model
    runs on a GPU."""
    if (settings.threads is not None or not settings.adaptive_threads or settings.deterministic
            or device.type != "cpu"):
        return None
    return ThreadGovernor(threads, torch.set_num_threads)


async def _load_and_run(settings: WorkerSettings, state: HealthState) -> None:
    engine_thread = EngineThread()  # load, warm-up and steps on one thread: one OpenMP team
    choice = choose_threads(settings.threads)
    log.info("%d CPU thread(s): %s", choice.threads, choice.why)
    await engine_thread.run(torch.set_num_threads, choice.threads)  # that thread's OpenMP team
    engine, model_name = await engine_thread.run(build_engine, settings)
    metrics = WorkerMetrics(settings.worker_id, model_name, settings.engine.batching)
    server = None
    if settings.health_port:
        server = start_health_server(settings.health_host, settings.health_port, state, metrics.registry)
    with Progress(f"warm-up forward pass of {settings.warmup_tokens} tokens"):  # logs how long it took
        await engine_thread.run(engine.runner.warmup, settings.warmup_tokens)
    redis = redis_client(settings.redis_url, settings.redis_password)
    tracer = configure_tracing("inflight-worker", settings.otlp_traces_endpoint)  # None: off
    governor = _thread_governor(settings, choice.threads, getattr(engine.runner, "device", torch.device("cpu")))
    service = WorkerService(settings, engine, redis, model_name, metrics, engine_thread, tracer=tracer,
                            before_step=governor.tick if governor else None)
    loop = asyncio.get_running_loop()

    def _drain() -> None:
        state.start_drain()
        service.stop(settings.drain_grace_s)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _drain)
    # the gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter, applied between steps; those
    # already in Redis before this worker announces itself or reads a stream (a worker restarted
    # under a stream of a run-time adapter would refuse its requests otherwise)
    sync = (LoraSync(redis, engine, engine_thread.run, model_name, settings.worker_id, settings.heartbeat_s)
            if hasattr(engine, "add_lora") else None)
    if sync is not None:
        await _first_lora_sync(sync)
    state.mark_ready()
    beat = asyncio.create_task(_heartbeat(redis, settings, engine, state))
    lora_sync = asyncio.create_task(sync.run()) if sync is not None else None
    log.info("worker %s ready: model=%s batching=%s blocks=%d", settings.worker_id, model_name,
             settings.engine.batching, engine.runner.num_blocks)
    try:
        await service.run()
    finally:
        beat.cancel()
        if sync is not None and lora_sync is not None:
            await stop_sync(sync, lora_sync)
        await redis.delete(heartbeat_key(settings.worker_id))
        await redis.aclose()
        if server is not None:
            server.shutdown()


def run_worker(settings: WorkerSettings) -> int:
    """Blocking entry point used by ``inflight worker``; returns an exit code."""
    asyncio.run(serve(settings))
    return 0
