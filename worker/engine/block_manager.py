"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, per-sequence
block tables and reference counts (PagedAttention, Kwon et al. SOSP'23), with
automatic prefix caching (see :mod:`worker.engine.prefix_cache`).

The manager never touches tensors: it hands out block ids, and the runner
writes token ``i`` of a sequence to slot ``table[i // block_size] * block_size
+ i % block_size``.

Block states: *empty* (on the free list, no content), *used* (ref count >= 1;
shared by several sequences through prefix hits and through :meth:`fork`, the
parallel-sampling share) and *cached* (ref count
0 but holding a hashed full block; reusable by a prefix hit, evicted least
recently used only when an empty block is needed and none is left). Blocks
leave the pool only through :meth:`_take_free_block` and return only through
:meth:`_release`.

Copy-on-write (Kwon et al. SOSP'23 §4.4): a sequence about to write a slot in a block
another sequence also holds gets a copy of that block first (:meth:`allocate` with
``write_from``); the manager records the ``(src, dst)`` pair and the runner copies the
block's KV before the step's forward (:meth:`take_copies`, ``ModelInput.blocks_to_copy``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from common.block_hash import adapter_salt
from worker.engine.prefix_cache import PrefixCache, block_hash, chain_hashes


@dataclass
class Block:
    """One KV block.

    Attributes:
        block_id: index into the runner's KV cache tensors (dim 0).
        ref_count: sequences whose table holds this block (> 1 only when
            shared through a prefix-cache hit or a fork).
    """

    block_id: int
    ref_count: int = 0


class BlockManager:
    """Allocates KV blocks to sequences on demand, sharing cached prefixes.

    Args:
        num_blocks: total blocks in the KV cache (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: hash full blocks and reuse them across
            sequences (vLLM automatic prefix caching).
        salt: model/adapter identity mixed into every block hash.
        record_events: keep the prefix cache's KV events (``cache.take_events()``).

    Raises:
        ValueError: on non-positive sizes.

    Every method is O(blocks touched); "no room" is returned as False, never
    raised.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False,
                 salt: str = "", record_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cache = PrefixCache(record_events and enable_prefix_caching)
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._chains: dict[int, list[int]] = {}  # seq -> hashes of its leading full computed blocks
        self._filled: dict[int, int] = {}  # seq -> tokens its table was asked to cover
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) pairs not yet taken

    # ---- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty + cached-evictable)."""
        return len(self._free) + self.cache.num_parked

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks still holding a reusable cached prefix block."""
        return self.cache.num_parked

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's kv cache usage)."""
        return self.num_used_blocks / self.num_blocks

    def fragmentation(self) -> float:
        """Internal fragmentation, 0..1: allocated-but-unused token slots over
        allocated slots of used blocks (a shared block counts once, as full as
        its fullest holder). 0 when nothing is allocated."""
        filled: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            n = self._filled[seq_id]
            for i, b in enumerate(table):
                filled[b] = max(filled.get(b, 0), min(self.block_size, n - i * self.block_size))
        slots = len(filled) * self.block_size
        return 0.0 if not slots else 1.0 - sum(max(0, f) for f in filled.values()) / slots

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks to add so ``seq_id``'s table covers ``num_tokens`` tokens."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def can_allocate(self, num_tokens: int, seq_id: int | None = None) -> bool:
        """True when ``seq_id`` (None = a new sequence) could cover
        ``num_tokens`` tokens with the blocks free now."""
        needed = self.blocks_for(num_tokens) if seq_id is None else self.num_new_blocks(seq_id, num_tokens)
        return needed <= self.num_free_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of ``seq_id``'s block ids in position order ([] if none)."""
        return list(self._tables.get(seq_id, ()))

    def has_blocks(self, seq_id: int) -> bool:
        """True when ``seq_id`` holds a block table."""
        return seq_id in self._tables

    def cached_prefix(self, token_ids: Seq[int], max_tokens: int, adapter: str = "") -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids`` covering at
        most ``max_tokens`` tokens (callers pass ``len - 1`` so the last token
        is always computed and yields logits), computed with LoRA ``adapter``
        (its identity; "" = the base model: :func:`common.block_hash.adapter_salt`). Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = None
        salt = adapter_salt(self.salt, adapter)
        for i in range(max(0, max_tokens) // self.block_size):
            parent = block_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size], salt)
            block_id = self.cache.lookup(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ---- changes -------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int, prefix: Seq[int] = (), write_from: int | None = None) -> bool:
        """Create or grow ``seq_id``'s table to cover ``num_tokens`` tokens
        (a prompt, a prefill chunk end, a worst-case reservation). A new
        table may start with ``prefix``, cached blocks from
        :meth:`cached_prefix`, which are shared (ref count + 1).

        ``write_from``: the first position the caller will write this step; when the
        block holding it is shared with another sequence, it is copied first
        (copy-on-write: a new block replaces it in this table, and the pair is kept
        for :meth:`take_copies`).

        Returns:
            True on success; False, with nothing changed, when too few blocks
            are free.
        """
        new = seq_id not in self._tables
        prefix = list(prefix) if new else []
        needed = self.num_new_blocks(seq_id, num_tokens) - len(prefix)
        shared = None if new or write_from is None else self._shared_block_index(seq_id, write_from)
        extra = 0 if shared is None else 1
        if max(0, needed) + extra > self.num_free_blocks - sum(self.cache.is_parked(b) for b in prefix):
            return False
        table = self._tables.setdefault(seq_id, [])
        if new:
            self._chains[seq_id] = [self.cache.hash_of[b] for b in prefix]
            self._filled[seq_id] = 0
        for b in prefix:
            self._share(b)
            table.append(b)
        for _ in range(max(0, needed)):
            table.append(self._take_free_block())
        if shared is not None:
            self._copy_on_write(table, shared)
        self._filled[seq_id] = max(self._filled[seq_id], num_tokens)
        return True

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> bool:
        """Give ``child_id`` (no table yet) the blocks holding ``parent_id``'s first
        ``num_tokens`` tokens, shared by reference count (parallel sampling: the choices
        of one request read the prompt's KV from the same blocks; the first to write into
        a shared block copies it, see :meth:`allocate`).

        Returns:
            False, with nothing changed, when the parent's table does not cover
            ``num_tokens`` or the child already has a table.

        Raises:
            ValueError: ``num_tokens`` < 1.
        """
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        parent = self._tables.get(parent_id, [])
        count = self.blocks_for(num_tokens)
        if child_id in self._tables or len(parent) < count:
            return False
        table = parent[:count]
        for b in table:
            self._share(b)
        self._tables[child_id] = table
        self._chains[child_id] = self._chains[parent_id][:count]
        self._filled[child_id] = num_tokens
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write ``(src, dst)`` block pairs recorded since the last call, in
        order; the runner must copy them before the step that writes into ``dst``."""
        copies, self._copies = self._copies, []
        return copies

    def append_slots(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int = 1) -> bool:
        """Ensure room for ``num_new_tokens`` more tokens after the
        ``num_computed_tokens`` already cached (a decode step).

        Returns:
            True on success; False, with nothing changed, when no block is free.
        """
        return self.allocate(seq_id, num_computed_tokens + num_new_tokens)

    def cache_full_blocks(self, seq_id: int, token_ids: Seq[int], num_computed_tokens: int,
                          adapter: str = "") -> None:
        """Hash every block of ``seq_id`` that became full of computed KV
        (prompt or generated tokens) and make it findable by later prefixes.
        ``token_ids`` are the sequence's prompt + output tokens; ``adapter`` the LoRA
        adapter's identity it was computed with ("" = the base model), as for :meth:`cached_prefix`."""
        if not self.enable_prefix_caching or seq_id not in self._tables:
            return
        chain, table = self._chains[seq_id], self._tables[seq_id]
        full = min(num_computed_tokens // self.block_size, len(table))
        parent = chain[-1] if chain else None
        for h in chain_hashes(token_ids, self.block_size, full, adapter_salt(self.salt, adapter), len(chain), parent):
            chain.append(h)
            self.cache.register(table[len(chain) - 1], h)

    def trim(self, seq_id: int, num_tokens: int) -> int:
        """Shrink ``seq_id``'s table to the blocks ``num_tokens`` tokens need, releasing
        the tail (speculative decoding: blocks reached only by rejected drafts). Never
        drops a block holding a registered prefix hash (those are full of computed
        tokens, below ``num_tokens``).

        Returns:
            The number of blocks released.
        """
        table = self._tables.get(seq_id)
        if table is None:
            return 0
        keep = max(self.blocks_for(num_tokens), len(self._chains[seq_id]))
        tail = table[keep:]
        del table[keep:]
        self._filled[seq_id] = min(self._filled[seq_id], num_tokens)
        for block_id in reversed(tail):
            self._release(block_id)
        return len(tail)

    def free(self, seq_id: int) -> int:
        """Release every block of ``seq_id`` (unknown ids are a no-op).

        Returns:
            The number of blocks whose ref count dropped.
        """
        table = self._tables.pop(seq_id, [])
        self._chains.pop(seq_id, None)
        self._filled.pop(seq_id, None)
        for block_id in reversed(table):  # tail first: the LRU keeps the prefix longest
            self._release(block_id)
        return len(table)

    def _shared_block_index(self, seq_id: int, position: int) -> int | None:
        """Index in ``seq_id``'s table of the block holding ``position`` when another
        sequence holds it too, else None."""
        index = position // self.block_size
        table = self._tables[seq_id]
        return index if index < len(table) and self.blocks[table[index]].ref_count > 1 else None

    def _copy_on_write(self, table: list[int], index: int) -> None:
        src = table[index]
        dst = self._take_free_block()
        self.blocks[src].ref_count -= 1  # still >= 1: another sequence holds it
        table[index] = dst
        self._copies.append((src, dst))

    # ---- the doors of the free pool ----------------------------------------
    def _share(self, block_id: int) -> None:
        if self.cache.is_parked(block_id):
            self.cache.unpark(block_id)
        self.blocks[block_id].ref_count += 1

    def _take_free_block(self) -> int:
        block_id = self._free.popleft() if self._free else self.cache.evict()
        assert block_id is not None, "no free block (callers check first)"
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released with ref_count {block.ref_count}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if self.cache.is_cached(block_id):
                self.cache.park(block_id)
            else:
                self._free.append(block_id)
