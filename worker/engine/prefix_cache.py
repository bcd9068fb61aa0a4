"""Automatic prefix caching: content hashes of full KV blocks and an LRU of
cached free blocks.

A full block is identified by a hash of its tokens chained to its parent
block's hash (and a salt naming the model/adapter), so equal hashes mean equal
whole prefixes, not just equal blocks. The idea is SGLang's RadixAttention
(Zheng et al. 2024: reuse KV of shared prefixes, evict least-recently-used);
the hashed-block realisation follows vLLM's "automatic prefix caching" design
docs (hash per full block, chained, freed blocks stay cached until evicted).
The hash is a 128-bit BLAKE2b digest, so accidental collisions are negligible.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq


def block_hash(parent: int | None, token_ids: Seq[int], salt: str = "") -> int:
    """Hash of one full block: its tokens, chained to the parent block's hash
    (None for the first block) and salted with the model identity."""
    h = hashlib.blake2b(digest_size=16)
    h.update(salt.encode())
    h.update(b"|" if parent is None else parent.to_bytes(16, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return int.from_bytes(h.digest(), "little")


def chain_hashes(token_ids: Seq[int], block_size: int, num_blocks: int, salt: str = "",
                 start: int = 0, parent: int | None = None) -> list[int]:
    """Hashes of full blocks ``start .. num_blocks - 1`` of ``token_ids``
    (blocks of ``block_size`` tokens), continuing the chain from ``parent``."""
    out = []
    for i in range(start, num_blocks):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        out.append(parent)
    return out


class PrefixCache:
    """Hash → block map plus the LRU of cached blocks nobody references.

    A block is "cached" while its hash maps to it. Cached blocks with ref
    count 0 sit in the LRU (oldest first) and are evicted only when a fresh
    block is needed and no never-used block is left.
    """

    def __init__(self) -> None:
        self._by_hash: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # block ids, least recently freed first
        self.hash_of: dict[int, int] = {}  # block id -> hash

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
        del self._by_hash[self.hash_of.pop(block_id)]
        return block_id

    @property
    def num_parked(self) -> int:
        """Cached blocks with ref count 0 (evictable)."""
        return len(self._lru)

    def lru_order(self) -> list[int]:
        """Parked block ids, next to be evicted first (for tests/debugging)."""
        return list(self._lru)
