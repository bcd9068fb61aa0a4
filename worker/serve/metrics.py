"""Worker Prometheus metrics (``inflight_`` prefix, vLLM-like meanings).

Each worker process exports its own series, labelled with its served model's id
(``model_name``, vLLM's label: its first ``--served-model-name``), worker id and batching
mode, from its own registry (no cross-process aggregation).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class WorkerMetrics:
    """The worker's metrics in a private registry (``.registry``) served on /metrics."""

    def __init__(self, worker_id: str, model: str, batching: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model, "worker": worker_id, "batching": batching}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        self.running = gauge("inflight_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("inflight_requests_waiting", "Sequences accepted but waiting in the engine.")
        self.kv_usage = gauge("inflight_kv_cache_usage", "Fraction of KV blocks in use (0..1).")
        self.blocks_free = gauge("inflight_kv_blocks_free", "KV blocks on the free list.")
        self.blocks_total = gauge("inflight_kv_blocks_total", "KV blocks in the pool.")
        self.blocks_cached = gauge("inflight_kv_blocks_cached",
                                   "Free KV blocks still holding a cached prefix (evictable).")
        self.fragmentation = gauge("inflight_kv_fragmentation",
                                   "Allocated-but-unused token slots over allocated slots (0..1).")
        self.prefix_queries = counter("inflight_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("inflight_prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache.")
        self.spec_draft_tokens = counter("inflight_spec_decode_num_draft_tokens",
                                         "Speculative decoding: draft tokens verified.")
        self.spec_accepted_tokens = counter("inflight_spec_decode_num_accepted_tokens",
                                            "Speculative decoding: draft tokens accepted.")
        self.batch_size = gauge("inflight_batch_size", "Sequences in the last engine step.")
        self.preemptions = counter("inflight_preemptions", "Sequences preempted (recompute).")
        self.generation_tokens = counter("inflight_generation_tokens", "Tokens generated.")
        self.aborts = counter("inflight_requests_aborted", "Requests aborted (cancel or lost link).")
        self.deferred = counter("inflight_requests_deferred",
                                "Queue entries left for a later delivery: their gateway could not be dialled.")
        self.step_time = histogram("inflight_step_seconds", "Wall time of one engine step, seconds.")
        self.queue_time = histogram("inflight_queue_time_seconds",
                                    "Time from enqueue to acceptance by a worker, seconds.")
        self.prompt_tps = gauge("inflight_avg_prompt_throughput_toks_per_s",
                                "Prompt tokens per second over the last minute (vLLM v0's gauge of this name).")
        self.generation_tps = gauge("inflight_avg_generation_throughput_toks_per_s",
                                    "Generated tokens per second over the last minute (vLLM v0's gauge of this "
                                    "name).")
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0, "drafts": 0, "accepted": 0}

    def observe_state(self, stats) -> None:
        """Record the engine's occupancy gauges from ``LLMEngine.stats()``."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.blocks_free.set(stats.num_free_blocks)
        self.blocks_total.set(stats.num_total_blocks)
        self.blocks_cached.set(stats.num_cached_blocks)
        self.fragmentation.set(stats.fragmentation)
        self._advance(self.preemptions, "preemptions", stats.num_preemptions)
        self._advance(self.prefix_queries, "queries", stats.prefix_cache_queries)
        self._advance(self.prefix_hits, "hits", stats.prefix_cache_hits)
        self._advance(self.spec_draft_tokens, "drafts", getattr(stats, "spec_num_draft_tokens", 0))
        self._advance(self.spec_accepted_tokens, "accepted", getattr(stats, "spec_num_accepted_tokens", 0))

    def observe_throughput(self, prompt_tps: float, generation_tps: float) -> None:
        """Set the last minute's throughput gauges (tokens per second; worker/serve/stats_logger.py)."""
        self.prompt_tps.set(prompt_tps)
        self.generation_tps.set(generation_tps)

    def _advance(self, counter: Counter, name: str, total: int) -> None:
        """Move a counter to the engine's running ``total`` (engine totals only grow)."""
        if total > self._seen[name]:
            counter.inc(total - self._seen[name])
            self._seen[name] = total

    def observe_step(self, stats, step_s: float, outputs) -> None:
        """Record one engine step: ``stats`` is ``LLMEngine.stats()``, ``step_s`` seconds."""
        self.observe_state(stats)
        self.batch_size.set(getattr(stats, "last_batch_size", stats.num_running))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in outputs))
        self.step_time.observe(step_s)
