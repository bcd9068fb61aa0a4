"""Gateway Prometheus metrics (``inflight_`` prefix, vLLM-like meanings).

One :class:`GatewayMetrics` per gateway, on its own registry, so several
gateways (tests) can live in one process.

The metrics of requests, tokens and latency carry ``model_name`` (vLLM's label): the served
model's id, the base model's for a LoRA adapter (gateway/model_registry.py's ``model_id``),
so its values are bounded by the gateway's configuration, never a string a client sent (an
unknown model is a 404 before it is noted). ``inflight_gateway_requests_total`` learns it
from the request's :func:`model_scope` (set by the REST middleware and the gRPC handlers,
filled by :func:`note_model` once admission resolved the model); a request refused before
that (a bad key, an unknown model, a malformed body) has ``model_name=""``.
``inflight_gateway_rejections_total`` follows the same rule (:meth:`GatewayMetrics.count_rejection`):
the model the request named once admission resolved it to a served model, else ``""`` (never the
name the client sent, which would let a client grow the label set).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: The label every per-model series carries (vLLM's name).
MODEL_LABEL = "model_name"
#: The current request's model holder (a one-item list: shared by the tasks and threads
#: the request's context is copied into, so a note made in one is seen by the counter).
_REQUEST_MODEL: ContextVar[list[str] | None] = ContextVar("inflight_request_model", default=None)


@contextmanager
def model_scope() -> Iterator[list[str]]:
    """One request's model holder for its duration; yields it (``holder[0]``: the model
    noted so far, "" before)."""
    holder = [""]
    token = _REQUEST_MODEL.set(holder)
    try:
        yield holder
    finally:
        _REQUEST_MODEL.reset(token)


def note_model(model_id: str) -> None:
    """Note the served model id the current request resolved to (no-op outside a
    :func:`model_scope`)."""
    holder = _REQUEST_MODEL.get()
    if holder is not None:
        holder[0] = model_id


def _noted(model_name: str | None) -> str:
    """``model_name``, or when None the current request's noted model ("" if none)."""
    if model_name is not None:
        return model_name
    holder = _REQUEST_MODEL.get()
    return holder[0] if holder else ""

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """Counters and histograms the REST and gRPC fronts update."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("inflight_gateway_requests",
                                "Requests by endpoint, status and model (model_name \"\" when refused before "
                                "the model was known)", ["endpoint", "status", MODEL_LABEL], registry=r)
        self.rejections = Counter("inflight_gateway_rejections",
                                  "Requests rejected before queueing, by reason (error code or kind) and model "
                                  "(model_name \"\" when refused before the model was known)",
                                  ["reason", MODEL_LABEL], registry=r)
        self.key_admissions = Counter(
            "inflight_gateway_key_admissions",
            "Requests of an API key that reached the rate limiter, by outcome: admitted, or the 429 "
            "reason (key_rate, key_tokens, in_flight, queue_full). Labelled by the key's tenant and public "
            "key_id (never the key itself): one series per key and outcome seen, so as many as the "
            "operator created keys", ["tenant", "key_id", "outcome"], registry=r)
        self.ttft = Histogram("inflight_time_to_first_token_seconds",
                              "Seconds from arrival to the first token", [MODEL_LABEL], buckets=_LATENCY_BUCKETS_S,
                              registry=r)
        self.e2e = Histogram("inflight_e2e_request_latency_seconds",
                             "Seconds from arrival to the last token", [MODEL_LABEL], buckets=_LATENCY_BUCKETS_S,
                             registry=r)
        self.prompt_tokens = Counter("inflight_gateway_prompt_tokens",
                                     "Prompt tokens of finished requests, as billed to clients (the workers' "
                                     "inflight_prompt_tokens counts engine work)", [MODEL_LABEL],
                                     registry=r)
        self.generation_tokens = Counter("inflight_gateway_generation_tokens",
                                         "Generated tokens of finished requests, as billed to clients (a "
                                         "continuation counts once)", [MODEL_LABEL], registry=r)
        self.itl = Histogram("inflight_inter_token_latency_seconds",
                             "Seconds between consecutive generated tokens of one request, as the gateway "
                             "receives them (vLLM's inter-token latency)", [MODEL_LABEL],
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)
        self.queue_depth = Gauge("inflight_queue_depth",
                                 "Entries queued for each model and priority class: its shared stream and its "
                                 "routable workers' own streams (read at scrape time)",
                                 [MODEL_LABEL, "priority"], registry=r)
        self.continuations = Counter("inflight_gateway_continuations",
                                     "Requests whose worker link dropped after acceptance, by outcome: "
                                     "resumed (re-queued as a continuation) or the error kind the client got",
                                     ["outcome"], registry=r)
        self.stream_resumes = Counter("inflight_gateway_stream_resumes",
                                      "Stream resumes (Last-Event-ID, gRPC Resume) and their outcomes, by how: "
                                      "replayed (a finished stream's journal), relayed (another connection's "
                                      "stream followed), taken_over (a relay whose owner was gone continued "
                                      "here), lease_lost (a stream of this gateway that another took over)",
                                      ["how"], registry=r)
        self.link_rejections = Counter("inflight_gateway_link_rejections",
                                       "Worker-link traffic refused, by reason: unauthenticated (a Connect "
                                       "without the right link secret) or foreign_request (output for a "
                                       "request another link session accepted, dropped)", ["reason"],
                                       registry=r)
        self.routed = Counter("inflight_gateway_routed",
                              "Requests queued by the KV-aware router, by target: worker (the own stream "
                              "of the worker holding the prompt's prefix) or shared (no worker stood out)",
                              ["target"], registry=r)
        self.redis_up = Gauge("inflight_gateway_redis_up",
                              "1 while the gateway's last Redis check (/ready, /metrics) got an answer, 0 "
                              "after one failed (Redis down, or a Sentinel failover under way)", registry=r)
        self.redis_up.set(1)
        self.waiting_clients = Gauge("inflight_gateway_waiting_clients",
                                     "Clients waiting for tokens on this gateway", registry=r)

    def observe_delta(self, gap_s: float, num_tokens: int, model_name: str) -> None:
        """Record ``num_tokens`` tokens of ``model_name`` that arrived ``gap_s`` seconds after
        the previous delta (the gap is shared evenly among them)."""
        itl = self.itl.labels(model_name)
        for _ in range(num_tokens):
            itl.observe(gap_s / num_tokens)

    def count_request(self, endpoint: str, status: str, model_name: str | None = None) -> None:
        """Count one request of ``endpoint`` ended with ``status`` (an HTTP code or a gRPC
        status name), under ``model_name``, by default the model its :func:`model_scope`
        noted ("" if none)."""
        self.requests.labels(endpoint=endpoint, status=status, model_name=_noted(model_name)).inc()

    def count_rejection(self, reason: str, model_name: str | None = None) -> None:
        """Count one request refused before queueing for ``reason``
        (``inflight_gateway_rejections_total``), under ``model_name`` (a served model's id),
        by default the model its :func:`model_scope` noted ("" if none: refused before its
        model was resolved)."""
        self.rejections.labels(reason=reason, model_name=_noted(model_name)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
