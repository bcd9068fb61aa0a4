"""The fleet view: workers and their models, running and waiting sequences, KV-cache use,
queue depth per priority, tokens per second over the last minute and the 429s of the last
minute by reason; what ``inflight status`` prints and the gateway's ``GET /fleet`` returns
(one collector, so the two cannot disagree).

Sources, all in Redis or on the workers' ``/metrics``:

* workers: their heartbeats ``inflight:workers:{id}`` (JSON, common/served_model.py: model,
  served names, tokenizer fingerprint, task, adapters, batching, started, metrics_url);
* per worker: its ``/metrics`` (``inflight_requests_running``, ``..._waiting``,
  ``inflight_kv_cache_usage``, ``inflight_avg_{prompt,generation}_throughput_toks_per_s``),
  or, when that does not answer, its load hash ``inflight:kv:{id}:load`` (running, waiting,
  free and total blocks; no throughput);
* queue depth: XLEN of each priority's shared streams (one per model: the live workers'
  models and those the caller names) plus the workers' own streams (as the gateway's
  ``inflight_queue_depth``, summed over models);
* 429s: the gateways count each rate-limit rejection by reason in 10-second buckets
  ``inflight:rl:rejections:{bucket}`` (:func:`record_rejection`), kept two minutes.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

from common.promtext import sample_sum
from common.redis_keys import HEARTBEAT_PREFIX, kv_load_key, rejections_key, stream_name, worker_stream
from common.served_model import Announcement

#: Seconds per 429 bucket, and how long a bucket lives.
REJECTION_BUCKET_S = 10
REJECTION_TTL_S = 120
#: "Recent" 429s: the last minute.
RECENT_S = 60
PRIORITIES = (0, 1, 2)
METRICS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class WorkerView:
    """One worker as the fleet view shows it.

    Attributes:
        worker_id: its id; model, batching: what it serves and how.
        served_model_names, task, adapters, tokenizer_fingerprint: what it announces
            (common/served_model.py).
        refused: why the gateway showing the view refuses it ("" = it does not; gateway/model_registry.py).
        up_s: seconds since it started serving.
        running, waiting: sequences in its batch and waiting in its engine.
        kv_usage: fraction of its KV blocks in use, 0..1.
        prompt_tps, generation_tps: tokens per second over the last minute (None: unknown,
            its metrics did not answer).
        metrics_url: where its metrics were read ("" when none was published).
        source: "metrics" (its /metrics answered) or "redis" (its load hash) or "none".
    """

    worker_id: str
    model: str = ""
    batching: str = ""
    served_model_names: tuple[str, ...] = ()
    task: str = "generate"
    adapters: tuple[str, ...] = ()
    tokenizer_fingerprint: str = ""
    refused: str = ""
    up_s: float = 0.0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prompt_tps: float | None = None
    generation_tps: float | None = None
    metrics_url: str = ""
    source: str = "none"


@dataclass(frozen=True)
class FleetView:
    """The whole fleet at one moment (``taken_unix_s``).

    Attributes:
        workers: one :class:`WorkerView` per live worker, by id.
        queue_depth: entries queued per priority class (0 = highest).
        rejections: 429s of the last minute by reason (key_rate, key_tokens, in_flight,
            queue_full), summed over every gateway.
    """

    workers: list[WorkerView] = field(default_factory=list)
    queue_depth: dict[int, int] = field(default_factory=dict)
    rejections: dict[str, int] = field(default_factory=dict)
    taken_unix_s: float = 0.0

    @property
    def generation_tps(self) -> float:
        """Generated tokens per second over the last minute, the whole fleet."""
        return sum(w.generation_tps or 0.0 for w in self.workers)

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens per second over the last minute, the whole fleet."""
        return sum(w.prompt_tps or 0.0 for w in self.workers)

    def to_json(self) -> dict:
        """A JSON-ready dict (``inflight status --json`` and ``GET /fleet``); priorities as strings."""
        return {"taken_unix_s": self.taken_unix_s, "workers": [asdict(w) for w in self.workers],
                "queue_depth": {str(p): n for p, n in sorted(self.queue_depth.items())},
                "rejections_last_minute": dict(sorted(self.rejections.items())),
                "prompt_tps": round(self.prompt_tps, 3), "generation_tps": round(self.generation_tps, 3)}


async def record_rejection(redis, reason: str, now: float | None = None) -> None:
    """Count one 429 of ``reason`` in the current 10-second bucket (a gateway calls this;
    ``redis`` is an asyncio client). Raises what the client raises on a Redis failure."""
    bucket = int((time.time() if now is None else now) // REJECTION_BUCKET_S)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hincrby(rejections_key(bucket), reason, 1)
        pipe.pexpire(rejections_key(bucket), REJECTION_TTL_S * 1000)
        await pipe.execute()


async def recent_rejections(redis, now: float | None = None) -> dict[str, int]:
    """429s by reason in the buckets of the last :data:`RECENT_S` seconds."""
    last = int((time.time() if now is None else now) // REJECTION_BUCKET_S)
    totals: dict[str, int] = {}
    for bucket in range(last - RECENT_S // REJECTION_BUCKET_S + 1, last + 1):
        for reason, count in (await redis.hgetall(rejections_key(bucket))).items():
            reason = reason.decode() if isinstance(reason, bytes) else reason
            totals[reason] = totals.get(reason, 0) + int(count)
    return totals


async def _worker_ids(redis) -> list[str]:
    ids = []
    async for key in redis.scan_iter(match=f"{HEARTBEAT_PREFIX}*", count=100):
        key = key.decode() if isinstance(key, bytes) else key
        ids.append(key[len(HEARTBEAT_PREFIX):])
    return sorted(ids)


async def _scrape(http, url: str) -> str | None:
    if not url or http is None:
        return None
    try:
        resp = await http.get(url, timeout=METRICS_TIMEOUT_S)
        return resp.text if resp.status_code == 200 else None
    except Exception:  # noqa: BLE001 - any transport failure: fall back to Redis
        return None


async def _worker(redis, http, worker_id: str, now: float) -> WorkerView | None:
    raw = await redis.get(f"{HEARTBEAT_PREFIX}{worker_id}")
    if raw is None:  # gone between the SCAN and the GET
        return None
    beat = json.loads(raw)
    ann = Announcement.parse(worker_id, raw)
    base = dict(worker_id=worker_id, model=beat.get("model", ""), batching=beat.get("batching", ""),
                up_s=max(0.0, now - float(beat.get("started", now))), metrics_url=beat.get("metrics_url", ""))
    if ann is not None:
        base.update(served_model_names=ann.served_model_names, task=ann.task, adapters=ann.adapters,
                    tokenizer_fingerprint=ann.tokenizer_fingerprint)
    text = await _scrape(http, base["metrics_url"])
    if text is not None:
        return WorkerView(**base, source="metrics",
                          running=int(sample_sum(text, "inflight_requests_running")),
                          waiting=int(sample_sum(text, "inflight_requests_waiting")),
                          kv_usage=sample_sum(text, "inflight_kv_cache_usage"),
                          prompt_tps=sample_sum(text, "inflight_avg_prompt_throughput_toks_per_s"),
                          generation_tps=sample_sum(text, "inflight_avg_generation_throughput_toks_per_s"))
    load = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in
            (await redis.hgetall(kv_load_key(worker_id))).items()
            if k not in (b"salt", "salt", b"lora_salts", "lora_salts")}  # the counts only
    if not load:
        return WorkerView(**base)
    total = load.get("total_blocks", 0)
    return WorkerView(**base, source="redis", running=load.get("running", 0), waiting=load.get("waiting", 0),
                      kv_usage=(1.0 - load.get("free_blocks", 0) / total) if total else 0.0)


async def collect_fleet(redis, http=None, priorities: tuple[int, ...] = PRIORITIES,
                        models: tuple[str, ...] = ()) -> FleetView:
    """Read the fleet view now.

    Args:
        redis: an asyncio Redis client whose user may SCAN and GET ``inflight:workers:*``,
            HGETALL ``inflight:kv:*`` and ``inflight:rl:rejections:*``, XLEN the request
            streams (the ``gateway`` and ``admin`` users of common/redis_acl.py).
        http: an ``httpx.AsyncClient`` for the workers' /metrics (None: Redis only).
        priorities: the priority classes whose queues are counted.
        models: model ids whose shared streams are counted beside those of the live workers.

    Raises:
        redis.RedisError, OSError: Redis failed.
    """
    now = time.time()
    ids = await _worker_ids(redis)
    workers = [w for w in await asyncio.gather(*(_worker(redis, http, i, now) for i in ids)) if w is not None]
    depth = {}
    served = sorted({*models, *(w.model for w in workers if w.model)})
    for p in priorities:
        depth[p] = sum([*[await redis.xlen(stream_name(p, m)) for m in served],
                        *[await redis.xlen(worker_stream(p, w.worker_id, w.model)) for w in workers if w.model]])
    return FleetView(workers=workers, queue_depth=depth, rejections=await recent_rejections(redis, now),
                     taken_unix_s=now)
