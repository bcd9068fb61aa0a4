"""Gateway Prometheus metrics (``inflight_`` prefix, vLLM-like meanings).

One :class:`GatewayMetrics` per gateway, on its own registry, so several
gateways (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """Counters and histograms the REST and gRPC fronts update."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("inflight_gateway_requests", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejections = Counter("inflight_gateway_rejections",
                                  "Requests rejected before queueing, by reason (error code or kind)", ["reason"],
                                  registry=r)
        self.key_admissions = Counter(
            "inflight_gateway_key_admissions",
            "Requests of an API key that reached the rate limiter, by outcome: admitted, or the 429 "
            "reason (key_rate, key_tokens, in_flight, queue_full). Labelled by the key's tenant and public "
            "key_id (never the key itself): one series per key and outcome seen, so as many as the "
            "operator created keys", ["tenant", "key_id", "outcome"], registry=r)
        self.ttft = Histogram("inflight_time_to_first_token_seconds",
                              "Seconds from arrival to the first token", buckets=_LATENCY_BUCKETS_S,
                              registry=r)
        self.e2e = Histogram("inflight_e2e_request_latency_seconds",
                             "Seconds from arrival to the last token", buckets=_LATENCY_BUCKETS_S,
                             registry=r)
        self.prompt_tokens = Counter("inflight_gateway_prompt_tokens",
                                     "Prompt tokens of finished requests, as billed to clients (the workers' "
                                     "inflight_prompt_tokens counts engine work)",
                                     registry=r)
        self.generation_tokens = Counter("inflight_gateway_generation_tokens",
                                         "Generated tokens of finished requests, as billed to clients (a continuation counts once)", registry=r)
        self.itl = Histogram("inflight_inter_token_latency_seconds",
                             "Seconds between consecutive generated tokens of one request, as the gateway "
                             "receives them (vLLM's inter-token latency)",
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)
        self.queue_depth = Gauge("inflight_queue_depth",
                                 "Entries queued for each model and priority class: its shared stream and its "
                                 "routable workers' own streams (read at scrape time)",
                                 ["model", "priority"], registry=r)
        self.continuations = Counter("inflight_gateway_continuations",
                                     "Requests whose worker link dropped after acceptance, by outcome: "
                                     "resumed (re-queued as a continuation) or the error kind the client got",
                                     ["outcome"], registry=r)
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

    def observe_delta(self, gap_s: float, num_tokens: int) -> None:
        """Record ``num_tokens`` tokens that arrived ``gap_s`` seconds after the previous delta
        (the gap is shared evenly among them)."""
        for _ in range(num_tokens):
            self.itl.observe(gap_s / num_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
