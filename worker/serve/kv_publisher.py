"""The worker's KV events and load, published to Redis for the gateway's KV-aware router.

As vLLM's KV events (``BlockStored`` / ``BlockRemoved``), every block hash the worker's
prefix cache registers or evicts (common/block_hash.py, worker/engine/prefix_cache.py) is
applied to the set ``inflight:kv:{worker_id}:blocks`` (16-byte members); a full snapshot
replaces it at the start, after any failed publish and every ``snapshot_s`` seconds, so
a lost event or a Redis that lost its data heals by itself. Its load goes to the hash
``inflight:kv:{worker_id}:load`` with a short TTL (``load_ttl_s``): running and waiting
sequences, entries held, free and total KV blocks, and what the gateway needs to compute
the same hashes (block size and salt). A worker that stops publishing (dead, stuck in a
long step, draining: :meth:`withdraw`) drops out of routing once the TTL runs out.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from common.block_hash import hash_bytes
from common.redis_keys import kv_blocks_key, kv_load_key
from worker.engine.engine import LLMEngine

#: SADD members per command in a snapshot (keeps each command small).
SNAPSHOT_CHUNK = 1000


@dataclass(frozen=True)
class PublishSettings:
    """How often and how long the published state lives (seconds).

    Attributes:
        interval_s: the most often the loop publishes (events and load).
        load_ttl_s: TTL of the load hash: the worker is routable while it is fresher.
        blocks_ttl_s: TTL of the block-hash set, renewed at every publish.
        snapshot_s: seconds between two full snapshots of the block hashes.
    """

    interval_s: float = 0.1
    load_ttl_s: float = 3.0
    blocks_ttl_s: float = 60.0
    snapshot_s: float = 30.0


@dataclass
class KVPublisher:
    """Publishes one engine's KV events and load (call :meth:`publish` between steps).

    Args:
        redis: an asyncio Redis client.
        worker_id: the worker's id (names the keys).
        engine: the engine (``config.enable_kv_events`` must be on for events).
        settings: intervals and TTLs.
    """

    redis: aioredis.Redis
    worker_id: str
    engine: LLMEngine
    settings: PublishSettings = field(default_factory=PublishSettings)
    _next_at: float = 0.0
    _snapshot_at: float = 0.0  # monotonic s of the next full snapshot; 0 = at the next publish
    _published: tuple[int, int] = (-1, -1)  # (running, waiting) of the last published load

    def due(self, held: int = 0) -> bool:
        """True when :meth:`publish` would talk to Redis now: ``interval_s`` has passed, or
        the number of running or waiting requests changed since the last publish (a request
        just admitted must count before the step that prefills it, which may take seconds:
        a router that saw this worker idle would queue more behind that prefill)."""
        load = self.engine.load()
        return (time.monotonic() >= self._next_at
                or (load.num_running, load.num_waiting + held) != self._published)

    async def publish(self, held: int = 0) -> None:
        """Apply the KV events since the last call (or a full snapshot when one is due)
        and refresh the load hash, when :meth:`due`.

        Args:
            held: queue entries this worker read but could not start yet (they count as waiting).

        Raises:
            redis.exceptions.RedisError, OSError: the next call sends a full snapshot.
        """
        if not self.due(held):
            return
        now = time.monotonic()
        self._next_at = now + self.settings.interval_s
        snapshot = now >= self._snapshot_at
        events = self.engine.take_kv_events()  # taken either way: a snapshot covers them
        blocks = kv_blocks_key(self.worker_id)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                if snapshot:
                    self._snapshot(pipe, blocks)
                else:
                    add, drop = events.net()
                    if add:
                        pipe.sadd(blocks, *map(hash_bytes, add))
                    if drop:
                        pipe.srem(blocks, *map(hash_bytes, drop))
                pipe.pexpire(blocks, int(self.settings.blocks_ttl_s * 1000))
                self._load(pipe, held)
                await pipe.execute()
        except BaseException:
            self._snapshot_at = 0.0  # the set may have missed these events: replace it next time
            raise
        if snapshot:
            self._snapshot_at = now + self.settings.snapshot_s

    def _snapshot(self, pipe, blocks: str) -> None:
        hashes = [hash_bytes(h) for h in self.engine.cached_block_hashes()]
        pipe.delete(blocks)
        for i in range(0, len(hashes), SNAPSHOT_CHUNK):
            pipe.sadd(blocks, *hashes[i:i + SNAPSHOT_CHUNK])

    def _load(self, pipe, held: int) -> None:
        load = self.engine.load()
        self._published = (load.num_running, load.num_waiting + held)
        key = kv_load_key(self.worker_id)
        pipe.hset(key, mapping={
            "running": load.num_running, "waiting": load.num_waiting + held,
            "free_blocks": load.num_free_blocks, "total_blocks": load.num_total_blocks,
            "block_size": self.engine.config.block_size, "salt": self.engine.block_hash_salt,
            "lora_salts": json.dumps(self._lora_salts(), sort_keys=True),
            "prefix_caching": int(self.engine.config.enable_prefix_caching)})
        pipe.pexpire(key, int(self.settings.load_ttl_s * 1000))

    def _lora_salts(self) -> dict[str, str]:
        """The adapters' identities in the block hashes (``LLMEngine.lora_salts``; {} for an
        engine without adapters), so the router can hash an adapter request's prompt."""
        salts = getattr(self.engine, "lora_salts", None)
        return salts() if salts is not None else {}

    async def withdraw(self) -> None:
        """Stop being routable at once (draining, stopping): delete the load hash and the
        block set.

        Raises:
            redis.exceptions.RedisError, OSError: Redis failed (the TTLs end them anyway).
        """
        await self.redis.delete(kv_load_key(self.worker_id), kv_blocks_key(self.worker_id))
        self._next_at = float("inf")
