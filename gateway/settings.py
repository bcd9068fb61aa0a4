"""Gateway settings: one frozen dataclass, built once at the entry point.

Nothing here reads the environment at import time; :meth:`GatewaySettings.from_env`
reads a mapping only when the entry point calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from gateway.model_config import ModelSpec
    from gateway.routing.scoring import RouterConfig


@dataclass(frozen=True)
class GatewaySettings:
    """Everything the gateway needs to run.

    Attributes:
        redis_url: Redis holding the request streams, API keys and worker heartbeats;
            ``redis://user@host:port/db`` (ACL user ``gateway``: deploy/redis/users.acl),
            ``rediss://`` for TLS, or ``unix:///path``.
        redis_password: the ACL user's password (None = the URL's, or none); read from a
            file by the entry point (``--redis-password-file``), not in repr.
        model_path: model spec for ``common.model_files.resolve_model_path``
            (None or "smollm2" = the default SmolLM2 GGUF); only its tokenizer is loaded.
        served_model_name: the model id clients see and may send in ``model``, when neither
            ``models`` nor ``models_file`` names the models (gateway/model_config.py).
        models: the models served, each ``NAME=PATH`` or ``PATH`` (``--model``, repeated; the
            environment's ``INFLIGHT_GATEWAY_MODELS`` separates them with commas); the first
            is the default (a request without ``model``). Empty: ``served_model_name`` at
            ``model_path``.
        models_file: a JSON (or YAML) file of models, ``[{"name", "path", "task"}]``, added
            after ``models`` ("" = none).
        rest_host, rest_port: OpenAI-compatible REST listener (default port 8000).
        grpc_host, grpc_port: public gRPC ``inflight.v1.Inference`` (default 50051).
        link_host, link_port: the link server workers dial (default 50052).
        link_secret: the shared secret workers must send on ``Link.Connect`` (None = no
            authentication, a warning at start); read from a file or the environment by the
            entry point (``common.credentials.link_secret``), never a flag value; not in repr.
        link_advertise: ``host:port`` written as ``reply_to`` in each queued request;
            empty = ``127.0.0.1:<link_port>``.
        otlp_traces_endpoint: OTLP collector for traces (vLLM's ``--otlp-traces-endpoint``,
            the same as ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); empty = the ``OTEL_*``
            environment decides, and without it tracing is off (common/tracing.py).
        default_max_tokens: tokens generated when a request sets no ``max_tokens``;
            the effective default is ``min(default_max_tokens, context - prompt)``.
        max_max_tokens: server-wide cap on ``max_tokens`` (tokens); 0 = the context length.
        max_n: the most choices (``n``, parallel sampling) one request may ask for; each
            choice's ``max_tokens`` counts against the key's tokens/min.
        request_timeout_s: seconds a request may take from arrival to its last
            token (also the queue deadline); a shorter gRPC deadline wins.
        redis_timeout_s: connect/command timeout towards Redis, seconds; keeps
            "Redis down" failures fast (503/UNAVAILABLE). Also the longest a command
            waits for a free pooled connection.
        redis_max_connections: connections the gateway's pool opens at most; a command
            beyond them waits (up to ``redis_timeout_s``) for one to be returned.
        grace_s: at SIGTERM, seconds open streams (SSE and gRPC) get to finish while new
            requests are refused; keep it below the orchestrator's kill timeout
            (compose stop_grace_period 30 s, k8s terminationGracePeriodSeconds 60 s).
        max_queue_depth: queue-depth backpressure: the most entries (XLEN) a priority
            stream may hold before new requests of that class get 429 ``queue_full``;
            one number for every class or "p0,p1,p2"; 0 = unlimited.
        busy_retry_after_s: ``Retry-After`` seconds for in-flight and queue-full rejections.
        require_worker: refuse new requests with 503 ``no_worker`` (and ``Retry-After``) while
            no worker heartbeat exists, as LiteLLM answers when no deployment is healthy,
            rather than queue them until ``request_timeout_s``; False lets them queue (a
            deployment that starts workers from the queue's length, from zero).
        max_continuations: times one request is re-queued as a continuation after its
            worker's link dropped (gateway/continuation.py); 0 = never, fail with UNAVAILABLE.
        completion_special_tokens: special-token strings (``<|im_start|>``) in a
            ``/v1/completions`` prompt: ``allow`` parses them as control tokens (vLLM's
            behaviour), ``escape`` tokenizes them as text, ``reject`` answers 400 naming the
            token. Chat message content is always text, whatever this says (docs/SECURITY.md).
        router_mode: "kv" (default: queue a request on the own stream of the worker whose
            prefix cache holds most of its prompt, load considered; NVIDIA Dynamo's
            ``--router-mode kv``) or "shared" (routing off: every request on the shared
            stream, workers pull as they have room). gateway/routing/scoring.py.
        kv_overlap_score_weight: weight of the prompt blocks a worker would have to prefill
            against the KV blocks its load holds (Dynamo's ``--kv-overlap-score-weight``).
        router_temperature: 0 = the lowest cost always wins; > 0 samples workers by
            softmax of their normalised costs (Dynamo's ``--router-temperature``).
        cache_threshold: least fraction (0..1] of the prompt's blocks the chosen worker must
            hold for the request to go to its own stream; below, the shared stream (SGLang
            router's ``--cache-threshold``).
        stream_resume_ttl_s: seconds a streamed request's journal stays in Redis after its
            last chunk, the window in which its client may resume it through any gateway with
            ``Last-Event-ID`` (gateway/stream_journal.py).
        stream_idle_timeout_s: a stream whose client has not taken a chunk for this many
            seconds (the socket's send blocks: a reader that stopped reading) is cancelled and
            its KV freed (``--stream-idle-timeout``; default 30 s, far above any live
            reader's pause and below nginx's 60 s ``proxy_send_timeout``).
        stream_owner_lease_s: seconds the owner lease of an open stream lives in Redis without a
            refresh (refreshed every third of it and at each chunk; gateway/stream_journal.py):
            a resume while it lives relays the owner's stream, and a gateway that died (or was
            stopped this long) is taken over by the resuming one within this (``--stream-owner-lease``).
        stream_buffer_events: the most events (deltas) one stream may hold unread in the
            gateway; beyond, it is cancelled with an error, so a slow reader's memory is
            bounded (Redis' client-output-buffer-limit does the same).
        link_keepalive_s: seconds between HTTP/2 pings on each worker link, and the most a
            ping waits for its answer: a worker that hangs (SIGSTOP, frozen VM, partition)
            without closing its socket is declared lost within twice this, and its requests
            become continuations on the other workers (``--link-keepalive``, default 5 s: lost
            within 10 s).
        log_content: the debug switch for request content: log each REST request's prompt (or
            messages) and its completion text at DEBUG on the ``gateway.content`` logger. Off,
            no log line at any level holds prompt or completion text (ids and counts only).
        reasoning_parser: vLLM's ``--reasoning-parser`` (``qwen3``, ``deepseek_r1``:
            ``common.reasoning``): a ``<think>`` model's thinking is returned apart from the
            answer; "" = off, the text is returned as the model wrote it.
        responses_ttl_s: seconds a stored ``/v1/responses`` response (``store: true``) stays
            readable by ``previous_response_id`` and ``GET /v1/responses/{id}``.
    """

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_password: str | None = field(default=None, repr=False)
    model_path: str | None = None
    served_model_name: str = "SmolLM2-135M-Instruct"
    models: tuple[str, ...] = ()
    models_file: str = ""
    rest_host: str = "0.0.0.0"
    rest_port: int = 8000
    grpc_host: str = "0.0.0.0"
    grpc_port: int = 50051
    link_host: str = "0.0.0.0"
    link_port: int = 50052
    link_advertise: str = ""
    link_secret: str | None = field(default=None, repr=False)
    otlp_traces_endpoint: str = ""
    default_max_tokens: int = 512
    max_max_tokens: int = 0
    max_n: int = 16
    request_timeout_s: float = 600.0
    redis_timeout_s: float = 2.0
    redis_max_connections: int = 256
    grace_s: float = 25.0
    max_queue_depth: str = "1024"
    busy_retry_after_s: float = 1.0
    max_continuations: int = 3
    require_worker: bool = True
    completion_special_tokens: str = "allow"
    log_content: bool = False
    router_mode: str = "kv"
    kv_overlap_score_weight: float = 2.0
    router_temperature: float = 0.0
    cache_threshold: float = 0.5
    reasoning_parser: str = ""
    responses_ttl_s: int = 86400
    stream_resume_ttl_s: int = 300
    stream_idle_timeout_s: float = 30.0
    stream_buffer_events: int = 4096
    stream_owner_lease_s: float = 5.0
    link_keepalive_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        self.router_config()  # raises ValueError on a tunable out of range
        if self.reasoning_parser:
            from common.reasoning import reasoning_format

            reasoning_format(self.reasoning_parser)  # ValueError naming the known parsers
        if self.stream_resume_ttl_s < 1:
            raise ValueError(f"stream_resume_ttl_s must be >= 1, got {self.stream_resume_ttl_s}")
        if self.stream_idle_timeout_s <= 0:
            raise ValueError(f"stream_idle_timeout_s must be > 0, got {self.stream_idle_timeout_s}")
        if self.link_keepalive_s <= 0:
            raise ValueError(f"link_keepalive_s must be > 0, got {self.link_keepalive_s}")
        if not 0.1 <= self.stream_owner_lease_s <= 3600:
            raise ValueError(f"stream_owner_lease_s must be in [0.1, 3600], got {self.stream_owner_lease_s}")
        if self.stream_buffer_events < 16:
            raise ValueError(f"stream_buffer_events must be >= 16, got {self.stream_buffer_events}")
        if self.max_continuations >= 64:  # gateway.stream_journal.RESUME_ATTEMPT_STRIDE
            raise ValueError(f"max_continuations must be < 64, got {self.max_continuations}")
        if self.responses_ttl_s < 1:
            raise ValueError(f"responses_ttl_s must be >= 1, got {self.responses_ttl_s}")
        if self.completion_special_tokens not in ("allow", "escape", "reject"):
            raise ValueError(f"completion_special_tokens must be allow, escape or reject, "
                             f"got {self.completion_special_tokens!r}")

    def model_specs(self) -> list[ModelSpec]:
        """The configured models, the default one first (gateway/model_config.py).

        Raises:
            ValueError: a malformed ``models`` entry or models file, or a name given twice.
        """
        from gateway.model_config import model_specs

        return model_specs(tuple(self.models), self.models_file, self.served_model_name, self.model_path)

    def queue_limit(self, priority: int) -> int:
        """The XLEN limit of priority class ``priority`` (0 = unlimited).

        Raises:
            ValueError: ``max_queue_depth`` is not one or three integers.
        """
        parts = [int(p) for p in str(self.max_queue_depth).split(",")]
        if len(parts) not in (1, 3):
            raise ValueError(f"max_queue_depth needs 1 or 3 integers, got {self.max_queue_depth!r}")
        return parts[0] if len(parts) == 1 else parts[min(priority, 2)]

    def router_config(self) -> RouterConfig:
        """The KV-aware router's tunables (gateway/routing/scoring.py).

        Raises:
            ValueError: a tunable out of range.
        """
        from gateway.routing.scoring import RouterConfig

        return RouterConfig(self.router_mode, self.kv_overlap_score_weight, self.router_temperature,
                            self.cache_threshold)

    @property
    def reply_to(self) -> str:
        """The link address workers dial back (``host:port``)."""
        return self.link_advertise or f"127.0.0.1:{self.link_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: object) -> "GatewaySettings":
        """Build settings from ``INFLIGHT_GATEWAY_<FIELD>`` variables in ``env``
        (e.g. ``INFLIGHT_GATEWAY_REST_PORT=9000``), then apply ``overrides``.

        Raises:
            ValueError: when a variable cannot be converted to the field's type.
        """
        values: dict[str, object] = {}
        for f in fields(cls):
            if not f.repr:  # secrets come from files or their own variables (common/credentials.py)
                continue
            raw = env.get(f"INFLIGHT_GATEWAY_{f.name.upper()}")
            if raw is None:
                continue
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if kind == "bool":
                values[f.name] = _parse_bool(f.name, raw)
            elif kind.startswith("int"):
                values[f.name] = int(raw)
            elif kind.startswith("float"):
                values[f.name] = float(raw)
            elif kind.startswith("tuple"):
                values[f.name] = tuple(part.strip() for part in raw.split(",") if part.strip())
            else:
                values[f.name] = raw
        values.update(overrides)
        return cls(**values)


def _parse_bool(name: str, raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case). Raises ValueError otherwise."""
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"INFLIGHT_GATEWAY_{name.upper()}={raw!r}: expected 1/0, true/false, yes/no or on/off")

