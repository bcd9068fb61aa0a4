"""The gateway's KV-cache-aware router: which stream a queued request goes to.

Every live worker publishes (worker/serve/kv_publisher.py) the block hashes its prefix
cache holds, a set ``inflight:kv:{id}:blocks``, and its load, a hash
``inflight:kv:{id}:load`` with a short TTL; it registers in its model's
``inflight:kv:workers:{model}`` (common/redis_keys.py). Only the workers of the request's
model (``QueuedRequest.model``) are candidates, less those the model registry refuses
(gateway/model_registry.py: another tokenizer, a model this gateway does not configure).
For each request the router hashes the prompt (plus the tokens a
continuation resumes after) with the one shared implementation, common/block_hash.py, with
each worker's own block size and salt, and in one pipelined round trip reads every
registered worker's load, the length of its own stream and which of the prompt's hashes it
holds (SMISMEMBER); :func:`gateway.routing.scoring.choose` then picks a worker or the shared
stream. A worker without a load hash (dead, draining, stuck in a long step, or not
publishing) is not a candidate.

The registry and each worker's block size and salt are re-read at most once a second.
A Redis failure while routing falls back to the shared stream (the XADD then reports
whether Redis is really down).

A worker whose link to this gateway dropped (:meth:`KvRouter.link_lost`: SIGKILLed, frozen
past the link keepalive, draining) is not a candidate from that moment until it links
again or ``LINK_LOST_HOLD_S`` pass: its load hash outlives it by up to its TTL (3 s), and
the continuations of the requests it ran hold a prefix only it cached, so without this they
would be routed straight back to its own stream and wait there for the takeover (its
heartbeat TTL, 10 s; worker/serve/takeover.py).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

import redis
import redis.asyncio

from common.block_hash import adapter_salt, hash_bytes, prompt_block_hashes
from common.redis_keys import kv_blocks_key, kv_load_key, router_workers, worker_stream
from gateway.routing.scoring import Choice, RouterConfig, WorkerView, choose
from protos import queue_pb2

log = logging.getLogger(__name__)

#: Seconds the registry (worker ids, block sizes, salts) is reused before it is read again.
REGISTRY_TTL_S = 1.0
#: Seconds a worker whose link dropped is not routed to, unless it links again first: longer
#: than its load hash's TTL (3 s, worker/serve/kv_publisher.py), after which it is no
#: candidate anyway until it publishes again (alive, it links again at once).
LINK_LOST_HOLD_S = 10.0


@dataclass(frozen=True)
class _Hashing:
    """How one worker hashes blocks (from its load hash): block size, the model's salt and
    its LoRA adapters' identities, ``(name, identity)`` pairs."""

    block_size: int
    salt: str
    lora: tuple[tuple[str, str], ...] = ()

    def salt_for(self, lora_name: str) -> str | None:
        """The salt of this worker's blocks for a request of adapter ``lora_name`` ("" = the
        base model); None when the worker does not serve that adapter (no block can match)."""
        if not lora_name:
            return self.salt
        identity = dict(self.lora).get(lora_name)
        return adapter_salt(self.salt, identity) if identity else None


def _hashing(fields: dict) -> _Hashing:
    """A worker's :class:`_Hashing` from its load hash."""
    lora = json.loads(_s(fields.get(b"lora_salts", fields.get("lora_salts", b"{}"))) or "{}")
    return _Hashing(_int(fields, "block_size"), _s(fields.get(b"salt", fields.get("salt", ""))),
                    tuple(sorted(lora.items())))


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(fields: dict, name: str) -> int:
    raw = fields.get(name.encode(), fields.get(name))
    return int(raw) if raw is not None else 0


def leading_hits(flags: list) -> int:
    """How many leading entries of an SMISMEMBER reply are 1: the cached prefix, in blocks
    (a chained hash past a miss cannot be a hit of this prompt's prefix)."""
    n = 0
    for flag in flags:
        if not int(flag):
            break
        n += 1
    return n


class KvRouter:
    """Chooses the stream of each queued request.

    Args:
        client: asyncio Redis client.
        config: the tunables (:class:`gateway.routing.scoring.RouterConfig`).
        rng: random source for ties and temperature sampling (tests pass a seeded one).
        refused: returns the ids of the workers never to route to (the model registry's
            refused workers); None: none.
    """

    def __init__(self, client: redis.asyncio.Redis, config: RouterConfig, rng: random.Random | None = None,
                 refused: Callable[[], Awaitable[Mapping[str, str]]] | None = None):
        self._redis = client
        self.config = config
        self._rng = rng or random.Random()
        self._refused = refused
        # model -> worker id -> how it hashes (registered, with a load, not refused)
        self._hashing: dict[str, dict[str, _Hashing]] = {}
        self._read_at: dict[str, float] = {}
        self._lost: dict[str, float] = {}  # worker id -> monotonic s until which it is not routed to

    def link_lost(self, worker_id: str, hold_s: float = LINK_LOST_HOLD_S) -> None:
        """``worker_id``'s link to this gateway dropped: route nothing to it for ``hold_s``
        seconds or until :meth:`link_up` (see the module docstring). "" (a link that never
        said Hello) is ignored."""
        if worker_id:
            self._routable([])  # forget the expired holds: the dict stays as small as the fleet
            self._lost[worker_id] = time.monotonic() + hold_s

    def link_up(self, worker_id: str) -> None:
        """``worker_id`` linked (again): a candidate as before."""
        self._lost.pop(worker_id, None)

    def _routable(self, workers: list[str]) -> list[str]:
        """``workers`` less those whose link dropped lately (expired holds are forgotten)."""
        if not self._lost:
            return workers
        now = time.monotonic()
        for worker in [w for w, until in self._lost.items() if until <= now]:
            del self._lost[worker]
        return [w for w in workers if w not in self._lost]

    @property
    def enabled(self) -> bool:
        """False when ``router_mode`` is "shared" (every request to the shared stream)."""
        return self.config.mode == "kv"

    async def workers(self, model: str) -> list[str]:
        """Registered worker ids of ``model`` with a load hash, less the refused ones (re-read
        at most every ``REGISTRY_TTL_S``).

        Raises:
            redis.RedisError, OSError: Redis failed.
        """
        now = time.monotonic()
        if now - self._read_at.get(model, float("-inf")) >= REGISTRY_TTL_S:
            refused = await self._refused() if self._refused is not None else {}
            ids = sorted(m for m in map(_s, await self._redis.smembers(router_workers(model))) if m not in refused)
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker in ids:
                    pipe.hgetall(kv_load_key(worker))
                loads = await pipe.execute()
            self._hashing[model] = {w: _hashing(f) for w, f in zip(ids, loads) if f and _int(f, "block_size") > 0}
            self._read_at[model] = now
        return list(self._hashing[model])

    async def route(self, message: queue_pb2.QueuedRequest) -> Choice:
        """The worker whose own stream ``message`` should go to, or ``Choice(None)``: the
        shared stream (routing off, no live worker, none stands out, or Redis failed)."""
        if not self.enabled:
            return Choice(None)
        tokens = list(message.prompt_token_ids) + list(message.resumed_token_ids)
        try:
            return await self._route(tokens, message.priority, message.model, message.lora_name)
        except (redis.RedisError, OSError) as exc:
            log.debug("routing skipped (%s): the shared stream", exc)
            return Choice(None)

    async def _route(self, tokens: list[int], priority: int, model: str, lora_name: str = "") -> Choice:
        workers = self._routable(await self.workers(model))
        if len(workers) < 2:  # nobody can stand out (scoring.choose): no round trip
            return Choice(None)
        hashing = self._hashing[model]
        hashes: dict[_Hashing, list[bytes]] = {}
        for h in set(hashing[w] for w in workers):
            limit = self.config.max_prefix_blocks * h.block_size + 1
            salt = h.salt_for(lora_name)  # an adapter's blocks are salted with its identity
            hashes[h] = ([] if salt is None else
                         [hash_bytes(x) for x in prompt_block_hashes(tokens[:limit], h.block_size, salt)])
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker in workers:
                pipe.hgetall(kv_load_key(worker))
                pipe.xlen(worker_stream(priority, worker, model))
                mine = hashes[hashing[worker]]
                if mine:
                    pipe.smismember(kv_blocks_key(worker), mine)
            replies = iter(await pipe.execute())
        views, prompt_blocks = [], 0
        for worker in workers:
            load, queued = next(replies), int(next(replies))
            mine = hashes[hashing[worker]]
            overlap = leading_hits(next(replies)) if mine else 0
            if not load:  # its load expired since the registry was read: gone or stuck
                continue
            prompt_blocks = max(prompt_blocks, len(mine))
            used = _int(load, "total_blocks") - _int(load, "free_blocks")
            views.append(WorkerView(worker, overlap, max(0, used), _int(load, "waiting") + queued))
        return choose(views, prompt_blocks, self.config, self._rng)

    async def queue_streams(self, priority: int, model: str) -> list[str]:
        """The own streams of this priority of ``model``'s workers routable now (for queue
        depth); [] when routing is off or Redis failed."""
        if not self.enabled:
            return []
        try:
            return [worker_stream(priority, w, model) for w in await self.workers(model)]
        except (redis.RedisError, OSError):
            return []
