"""Worker settings: one frozen dataclass built once at the entry point (CLI) and passed in."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from common.served_model import default_served_name
from worker.engine.engine_config import EngineConfig
from worker.engine.pooler import PoolerConfig


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerSettings:
    """How one worker process runs.

    Attributes:
        redis_url: ``redis://user@host:port/db`` (ACL user ``worker``), ``rediss://`` (TLS) or
            ``unix:///path/redis.sock``.
        redis_password: the ACL user's password (None = the URL's, or none); read from a file
            by the entry point (``--redis-password-file``); not in repr.
        model: model spec for ``common.model_files.resolve_model_path`` (None = SmolLM2-135M-Instruct).
        served_model_name: the names clients use (vLLM's ``--served-model-name``): the first is
            the model's id, which names the request streams read (``inflight:requests:{id}:{p}``),
            the others are aliases; () = :func:`common.served_model.default_served_name` of ``model``.
        device: "auto" (a CUDA GPU when torch sees one, else the CPU) | "cpu" | "cuda" | "cuda:N";
            see :func:`worker.model.device.resolve_device`.
        dtype: "auto" | "float32" | "bfloat16" | "float16".
        kv_cache_dtype: element dtype of the KV cache, "auto" | "float32" | "bfloat16" | "float16"
            (auto: the compute dtype, float16 for float32 compute on a CPU with the compiled
            attention kernel; :func:`worker.model.dtype.resolve_kv_cache_dtype`).
        quantization: "auto" (default: "gguf" for a GGUF file on the CPU with float32
            compute, else "none"), "none", "gguf" (the file's Q4_1/Q8_0 blocks, weight-only),
            "q8_0" or "q4_1" (int8 activations); CPU and float32 only
            (:mod:`worker.model.quantization`).
        dense_weights_min_rows: with ``gguf`` blocks, steps of at least this many rows multiply
            dense bfloat16 copies of the Q4_1/Q8_0 weights instead (bfloat16 activations only:
            :func:`worker.model.dense_weights.with_dense`) and K-quant weights through tiles dequantized
            per product (bfloat16 on AVX-512 BF16, float32 on AVX2) (0 = off); None = auto (16 where
            the blocks take bfloat16 activations, 8 for a file whose blocks are all K-quants there,
            32 for K-quants on AVX2 CPUs; the copies off when they would not fit the memory left
            after loading; off with ``deterministic``:
            :func:`worker.model.dense_weights.resolve_dense_min_rows`,
            :func:`worker.model.dense_weights.fit_dense_to_memory`).
        threads: CPU threads of torch's intra-op pool and our OpenMP kernels (None = the
            smaller of the affinity mask and the cgroup CPU quota; worker/serve/cpu_threads.py).
        adaptive_threads: on a CPU device without ``threads``, give threads up while other
            processes take CPUs of the affinity mask and take them back when they stop
            (worker/serve/thread_governor.py).
        deterministic: refuse to start unless every op of the step is batch-invariant
            (:mod:`worker.model.determinism`), and keep the thread count fixed; a request's
            greedy text and logprobs are then the same whatever else runs beside it.
        engine: the engine core's settings (batching mode, batch size, per-step token
            budget, KV block size and count, waiting-queue policy, prefix caching; see
            :class:`worker.engine.engine_config.EngineConfig`); its ``num_blocks`` None means
            "from ``kv_cache_bytes``", resolved when the KV cache is allocated.
        kv_cache_bytes: KV pool size in bytes when ``engine.num_blocks`` is None (None = 512 MiB
            on the CPU, 90% of the free memory on a GPU once the weights are loaded).
        priorities: priority classes read, highest first (stream ``inflight:requests:{model}:{p}``).
        poll_ms: how long an idle worker blocks on XREADGROUP, milliseconds.
        heartbeat_s / heartbeat_ttl_s: registration refresh period and TTL, seconds.
        health_port: HTTP port of /health, /ready and /metrics (0 = off).
        health_host: address both health servers listen on ("0.0.0.0" in containers).
        grpc_health_port: port of the standard grpc.health.v1 service and reflection (0 = off);
            NOT_SERVING until warm-up ran, SERVING after, NOT_SERVING once draining.
        warmup_tokens: prompt length of the warm-up forward pass run before reporting ready.
        claim_idle_ms: an unacknowledged entry idle this long (a dead worker's) is
            reclaimed by another worker, milliseconds.
        max_deliveries: deliveries after which an entry goes to the dead-letter stream.
        stream_interval: tokens per streamed delta after a request's first token (1 = each
            token as soon as it is sampled; N > 1 = fewer, larger messages to the gateway and
            the client, as SGLang's and vLLM's ``--stream-interval``; worker/serve/stream_interval.py).
        link_secret: the shared secret sent as ``x-inflight-link-secret`` metadata on every
            ``Link.Connect`` (None = none; a gateway that has one refuses the link). Read from
            a file or the environment by the entry point, never a flag value; not in repr.
        drain_grace_s: after SIGTERM, seconds running requests get to finish before the
            rest are handed back to their gateways as continuations; keep it below the
            orchestrator's kill timeout (compose stop_grace_period 60 s, k8s
            terminationGracePeriodSeconds 120 s).
        kv_events: publish the prefix cache's block hashes (KV events) and the load to Redis
            for the gateway's KV-aware router (worker/serve/kv_publisher.py); off, the router
            never picks this worker and it serves the shared streams (and gone workers' own).
        log_stats: log throughput, running/waiting sequences and KV-cache use every 10 s at INFO
            (vLLM's ``log_stats``; ``--disable-log-stats`` turns it off; worker/serve/stats_logger.py).
        runner: "generate" (completions, chat: the default) or "pooling" (embeddings only, vLLM's
            ``--runner pooling``: worker/engine/pooling_engine.py); each refuses the other's
            requests with a 400-class error.
        pooler_config: with ``runner`` "pooling", the pooling type and normalization (vLLM's
            ``--pooler-config``; default LAST pooling, normalized).
        lora_modules: LoRA adapters served from the start, ``(name, path)`` pairs (vLLM's
            ``--lora-modules name=path``; needs ``engine.enable_lora``, whose ``max_loras`` bounds
            those loaded at once).
        max_lora_rank: highest LoRA rank loaded (``--max-lora-rank``, vLLM's default 16).
        otlp_traces_endpoint: OTLP collector for traces (vLLM's ``--otlp-traces-endpoint``,
            the same as ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); empty = the ``OTEL_*``
            environment decides, and without it tracing is off (common/tracing.py).
    """

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str | None = field(default=None, repr=False)
    model: str | None = None
    served_model_name: tuple[str, ...] = ()
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    dense_weights_min_rows: int | None = None
    threads: int | None = None
    adaptive_threads: bool = True
    deterministic: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_cache_bytes: int | None = None
    priorities: tuple[int, ...] = (0, 1, 2)
    poll_ms: int = 100
    heartbeat_s: float = 2.0
    heartbeat_ttl_s: int = 10
    health_port: int = 9100
    health_host: str = "127.0.0.1"
    grpc_health_port: int = 9101
    warmup_tokens: int = 256
    claim_idle_ms: int = 30_000
    max_deliveries: int = 3
    stream_interval: int = 1
    drain_grace_s: float = 45.0
    kv_events: bool = True
    log_stats: bool = True
    otlp_traces_endpoint: str = ""
    runner: str = "generate"
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 16
    worker_id: str = field(default_factory=_default_worker_id)
    link_secret: str | None = field(default=None, repr=False)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names this worker serves, its model's id first (``served_model_name``, or the
        default name of ``model``)."""
        return tuple(self.served_model_name) or (default_served_name(self.model),)

    @property
    def model_id(self) -> str:
        """The model's id: the first served name; it names the request streams read."""
        return self.served_names[0]
