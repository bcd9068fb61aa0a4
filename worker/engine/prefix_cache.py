"""Automatic prefix caching: content hashes of full KV blocks and an LRU of
cached free blocks.

A full block is identified by a hash of its tokens chained to its parent
block's hash (and a salt naming the model/adapter), so equal hashes mean equal
whole prefixes, not just equal blocks. The idea is SGLang's RadixAttention
(Zheng et al. 2024: reuse KV of shared prefixes, evict least-recently-used);
the hashed-block realisation follows vLLM's "automatic prefix caching" design
docs (hash per full block, chained, freed blocks stay cached until evicted).
The hash (a 128-bit BLAKE2b digest) lives in :mod:`common.block_hash`, shared with
the gateway's KV-aware router, which computes the same hashes of a prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from common.block_hash import block_hash, chain_hashes

__all__ = ["KVEvents", "PrefixCache", "block_hash", "chain_hashes"]


@dataclass
class KVEvents:
    """What the prefix cache gained and lost since the last :meth:`PrefixCache.take_events`,
    as vLLM's KV events: ``(True, hash)`` a block stored (BlockStored), ``(False, hash)`` one
    evicted (BlockRemoved), in the order they happened; hashes are unsigned 128-bit ints
    (:mod:`common.block_hash`)."""

    log: list[tuple[bool, int]] = field(default_factory=list)

    def record(self, stored: bool, h: int) -> None:
        """Append one event (``stored`` True: BlockStored, False: BlockRemoved)."""
        self.log.append((stored, h))

    def net(self) -> tuple[set[int], set[int]]:
        """(hashes to add, hashes to drop) once the whole batch is applied: the last event
        of each hash wins (a block evicted and stored again in one batch is held)."""
        last: dict[int, bool] = {}
        for stored, h in self.log:
            last[h] = stored
        return {h for h, s in last.items() if s}, {h for h, s in last.items() if not s}

    def __len__(self) -> int:
        return len(self.log)


class PrefixCache:
    """Hash → block map plus the LRU of cached blocks nobody references.

    A block is "cached" while its hash maps to it. Cached blocks with ref
    count 0 sit in the LRU (oldest first) and are evicted only when a fresh
    block is needed and no never-used block is left.

    Args:
        record_events: keep :class:`KVEvents` of every hash registered and evicted until
            :meth:`take_events` (the worker publishes them for KV-aware routing); off, nothing
            is kept.
    """

    def __init__(self, record_events: bool = False) -> None:
        self._by_hash: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # block ids, least recently freed first
        self.hash_of: dict[int, int] = {}  # block id -> hash
        self._events: KVEvents | None = KVEvents() if record_events else None

    def take_events(self) -> KVEvents:
        """The events since the last call (empty when recording is off), and start anew."""
        events = self._events or KVEvents()
        if self._events is not None:
            self._events = KVEvents()
        return events

    def hashes(self) -> list[int]:
        """Every hash the cache holds now (in use or parked): a full snapshot."""
        return list(self._by_hash)

    def lookup(self, h: int) -> int | None:
        """The cached block holding hash ``h``, or None."""
        return self._by_hash.get(h)

    def register(self, block_id: int, h: int) -> bool:
        """Record ``block_id`` as holding ``h``; False (nothing changed) when
        another block already holds it (two sequences computed it at once)."""
        if h in self._by_hash or block_id in self.hash_of:
            return False
        self._by_hash[h] = block_id
        self.hash_of[block_id] = h
        if self._events is not None:
            self._events.record(True, h)
        return True

    def is_cached(self, block_id: int) -> bool:
        """True when ``block_id`` holds a registered hash."""
        return block_id in self.hash_of

    def park(self, block_id: int) -> None:
        """A cached block lost its last reference: most recently used end."""
        self._lru[block_id] = None

    def unpark(self, block_id: int) -> None:
        """A parked block is referenced again (a prefix hit)."""
        del self._lru[block_id]

    def is_parked(self, block_id: int) -> bool:
        """True when ``block_id`` is cached and unreferenced."""
        return block_id in self._lru

    def evict(self) -> int | None:
        """Drop the least recently used parked block from the cache and
        return its id (None when nothing is parked)."""
        if not self._lru:
            return None
        block_id, _ = self._lru.popitem(last=False)
        h = self.hash_of.pop(block_id)
        del self._by_hash[h]
        if self._events is not None:
            self._events.record(False, h)
        return block_id

    @property
    def num_parked(self) -> int:
        """Cached blocks with ref count 0 (evictable)."""
        return len(self._lru)

    def lru_order(self) -> list[int]:
        """Parked block ids, next to be evicted first (for tests/debugging)."""
        return list(self._lru)
