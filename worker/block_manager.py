"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, per-sequence
block tables and reference counts (PagedAttention, Kwon et al. SOSP'23).

The manager never touches tensors: it hands out block ids, and the runner
writes token ``i`` of a sequence to slot ``table[i // block_size] * block_size
+ i % block_size``.

Prefix caching fits in later without a rewrite: every block already carries a
ref count and a ``block_hash`` slot (hash of its full token content chained to
its parent block's hash); blocks leave the free pool only through
:meth:`_take_free_block`, where an LRU of cached free blocks would be evicted,
and return through :meth:`_release`, where a hashed block would join that LRU
instead of the plain free list.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Block:
    """One KV block.

    Attributes:
        block_id: index into the runner's KV cache tensors (dim 0).
        ref_count: sequences whose table holds this block (> 1 only once
            blocks are shared by prefix caching).
        block_hash: hash of the full block chained to its parent's; None while
            not full or not cached (prefix caching, not implemented yet).
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class BlockManager:
    """Allocates KV blocks to sequences on demand.

    Args:
        num_blocks: total blocks in the KV cache (>= 1).
        block_size: tokens per block (>= 1).

    Raises:
        ValueError: on non-positive sizes.

    Every method is O(blocks touched); "no room" is returned as False, never
    raised.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}

    # ---- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's kv cache usage)."""
        return self.num_used_blocks / self.num_blocks

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
        return needed <= len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of ``seq_id``'s block ids in position order ([] if none)."""
        return list(self._tables.get(seq_id, ()))

    def has_blocks(self, seq_id: int) -> bool:
        """True when ``seq_id`` holds a block table."""
        return seq_id in self._tables

    # ---- changes -------------------------------------------------------
    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Create or grow ``seq_id``'s table to cover ``num_tokens`` tokens
        (a prompt, a prefill chunk end, a worst-case reservation).

        Returns:
            True on success; False, with nothing changed, when too few blocks
            are free.
        """
        needed = self.num_new_blocks(seq_id, num_tokens)
        if needed > len(self._free):
            return False
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            table.append(self._take_free_block())
        return True

    def append_slots(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int = 1) -> bool:
        """Ensure room for ``num_new_tokens`` more tokens after the
        ``num_computed_tokens`` already cached (a decode step).

        Returns:
            True on success; False, with nothing changed, when no block is free.
        """
        return self.allocate(seq_id, num_computed_tokens + num_new_tokens)

    def free(self, seq_id: int) -> int:
        """Release every block of ``seq_id`` (unknown ids are a no-op).

        Returns:
            The number of blocks whose ref count dropped.
        """
        table = self._tables.pop(seq_id, [])
        for block_id in reversed(table):  # tail first: the LRU would keep the prefix longest
            self._release(block_id)
        return len(table)

    # ---- the two doors of the free pool -------------------------------------
    def _take_free_block(self) -> int:
        block_id = self._free.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        block.ref_count = 1
        block.block_hash = None
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released with ref_count {block.ref_count}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free.append(block_id)
