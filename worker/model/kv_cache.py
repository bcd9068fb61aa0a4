"""The paged KV cache: per-layer key/value tensors of fixed-size blocks.

Layout per layer (docs/CONTRACTS.md): ``[num_blocks, num_kv_heads, block_size, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one block across all layers.

    Attributes:
        num_layers, num_kv_heads, block_size (tokens), head_dim: cache geometry.
        dtype: element dtype (the compute dtype, or float16 or bfloat16 under float32
            compute on the CPU: :func:`worker.model.dtype.resolve_kv_cache_dtype`).
    """

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes in K and V over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * itemsize

    def blocks_for_bytes(self, budget_bytes: int) -> int:
        """Whole blocks that fit in ``budget_bytes``.

        Raises:
            ValueError: the budget does not hold a single block.
        """
        count = int(budget_bytes) // self.bytes_per_block
        if count < 1:
            raise ValueError(f"kv_cache_bytes={budget_bytes} is below one block ({self.bytes_per_block} bytes)")
        return count


class KVCache:
    """Zero-initialised per-layer caches.

    Attributes:
        spec: the geometry.
        num_blocks: blocks per layer.
        layers: per layer ``(key_cache, value_cache)``, each
            ``[num_blocks, num_kv_heads, block_size, head_dim]``.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(spec.num_layers)
        ]

    @classmethod
    def allocate(cls, spec: KVCacheSpec, *, num_blocks: int | None = None, budget_bytes: int | None = None,
                 device: str | torch.device = "cpu") -> "KVCache":
        """Allocate by block count or by byte budget (exactly one must be given).

        Raises:
            ValueError: neither or both given, or a budget below one block.
        """
        if (num_blocks is None) == (budget_bytes is None):
            raise ValueError(f"give exactly one of num_blocks ({num_blocks}) and budget_bytes ({budget_bytes})")
        return cls(spec, num_blocks if num_blocks is not None else spec.blocks_for_bytes(budget_bytes), device)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.spec.block_size

    @property
    def total_bytes(self) -> int:
        """Bytes held by all layers."""
        return self.num_blocks * self.spec.bytes_per_block

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src``'s keys and values to block ``dst`` in every layer, for each
        ``(src, dst)`` (copy-on-write of a shared block; same device, no host sync). The
        ``dst`` blocks are distinct and none is a ``src`` of the same call: each is a fresh
        block of the one sequence that copies."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.layers[0][0].device)
        dst = torch.tensor([p[1] for p in pairs], device=self.layers[0][0].device)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]

    def snapshot(self, block_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the given blocks in every layer (to restore after scratch use)."""
        return [(k[block_ids].clone(), v[block_ids].clone()) for k, v in self.layers]

    def restore(self, block_ids: torch.Tensor, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write back blocks taken with :meth:`snapshot`."""
        for (k, v), (k_saved, v_saved) in zip(self.layers, saved):
            k[block_ids] = k_saved
            v[block_ids] = v_saved
