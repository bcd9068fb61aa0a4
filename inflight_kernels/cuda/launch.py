"""Launch configuration of the CUDA kernels: pure Python, no torch, no CuPy.

Everything here mirrors constants and the shared-memory carve-up of
``inflight_kernels/cuda/paged_attention.cu`` (``TILE``, ``NUM_THREADS``, ``SmemLayout``) and
is unit-tested on the CPU. Sizes are in elements unless a name ends in ``bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_TOKENS = 32  # tokens staged per tile (csrc TILE)
NUM_THREADS = 128  # threads per block of every kernel (csrc NUM_THREADS)
PARTITION_SIZE = 512  # tokens per context partition in the split variant
DEFAULT_SMEM_BYTES = 48 * 1024  # dynamic shared memory allowed without opt-in
SPLIT_LONG_CONTEXT = 8192  # tokens: past this, always split when there are >1 partitions
SPLIT_WAVES = 2  # split when single-pass blocks < SPLIT_WAVES * SM count
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class AttentionLaunch:
    """Launch of ``paged_attention_kernel`` (and, when ``split``, the reduction).

    grid = (num_kv_heads, num_seqs, num_partitions); block = (NUM_THREADS,).
    ``smem_bytes`` is the dynamic shared memory of the main kernel;
    ``needs_opt_in`` is True when it exceeds the 48 KiB default, so the caller must
    raise the kernel's max dynamic shared memory attribute first.
    """

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    needs_opt_in: bool
    num_partitions: int
    partition_size: int
    split: bool
    max_context: int
    reduce_grid: tuple[int, int, int]
    reduce_smem_bytes: int


def attention_smem_bytes(head_size: int, gqa: int, dtype_bytes: int) -> int:
    """Dynamic shared memory of ``paged_attention_kernel`` in bytes.

    K and V tiles (TILE_TOKENS x head_size of the cache dtype each), then fp32:
    query and accumulator (gqa x head_size each), scores (gqa x TILE_TOKENS) and
    running max / sum / rescale (3 x gqa).
    """
    kv = 2 * TILE_TOKENS * head_size * dtype_bytes
    fp32 = 2 * gqa * head_size + gqa * TILE_TOKENS + 3 * gqa
    return kv + 4 * fp32


def num_partitions(max_context: int, partition_size: int = PARTITION_SIZE) -> int:
    """Context partitions covering ``max_context`` tokens (at least 1)."""
    return max(1, -(-max_context // partition_size))


def use_split_context(num_seqs: int, num_kv_heads: int, max_context: int, sm_count: int) -> bool:
    """The rule choosing the split-context (Flash-Decoding) variant.

    Split when there is more than one partition and either the single-pass grid
    (num_seqs x num_kv_heads blocks) is below SPLIT_WAVES blocks per SM, so most
    SMs would idle while few blocks walk long contexts, or the context exceeds
    SPLIT_LONG_CONTEXT tokens, where one block per head serializes too much work
    and ragged lengths unbalance the SMs. Otherwise single pass: the partial
    outputs and the reduction launch cost more than they save.
    """
    if num_partitions(max_context) == 1:
        return False
    if num_seqs * num_kv_heads < SPLIT_WAVES * sm_count:
        return True
    return max_context > SPLIT_LONG_CONTEXT


def _check_smem(smem_bytes: int, smem_opt_in_limit: int) -> None:
    if smem_bytes > max(smem_opt_in_limit, DEFAULT_SMEM_BYTES):
        raise ValueError(
            f"paged_attention needs {smem_bytes} bytes of shared memory per block, over the "
            f"device's opt-in limit of {smem_opt_in_limit} bytes; lower the GQA ratio or head size"
        )


def plan_attention(num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                   block_size: int, max_blocks_per_seq: int, dtype_bytes: int,
                   sm_count: int, smem_opt_in_limit: int) -> AttentionLaunch:
    """Plan one decode launch; no device synchronization needed.

    The context bound is ``max_blocks_per_seq * block_size`` (host-known, so the
    engine should size block_tables to the batch's longest sequence). Raises
    ValueError for a GQA ratio that does not divide, a grid over CUDA's limits or
    shared memory over ``smem_opt_in_limit`` (bytes).
    """
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    gqa = num_heads // num_kv_heads
    max_context = max_blocks_per_seq * block_size
    split = num_partitions(max_context) > 1 and use_split_context(num_seqs, num_kv_heads, max_context, sm_count)
    parts = num_partitions(max_context) if split else 1
    psize = PARTITION_SIZE if split else max(TILE_TOKENS, -(-max_context // TILE_TOKENS) * TILE_TOKENS)
    if num_seqs > MAX_GRID_YZ or parts > MAX_GRID_YZ:
        raise ValueError(f"grid too large: num_seqs={num_seqs}, partitions={parts} (limit {MAX_GRID_YZ})")
    smem = attention_smem_bytes(head_size, gqa, dtype_bytes)
    _check_smem(smem, smem_opt_in_limit)
    return AttentionLaunch(
        grid=(num_kv_heads, num_seqs, parts), block=(NUM_THREADS, 1, 1), smem_bytes=smem,
        needs_opt_in=smem > DEFAULT_SMEM_BYTES, num_partitions=parts, partition_size=psize,
        split=split, max_context=max_context, reduce_grid=(num_heads, num_seqs, 1),
        reduce_smem_bytes=4 * (parts + 1),
    )


def plan_reshape_and_cache(num_tokens: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of ``reshape_and_cache_kernel``: one block of NUM_THREADS per token."""
    if num_tokens >= 2**31:
        raise ValueError(f"num_tokens={num_tokens} exceeds the grid's x limit")
    return (num_tokens, 1, 1), (NUM_THREADS, 1, 1)


def attention_bytes(context_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int,
                    dtype_bytes: int, partitions: int = 1) -> int:
    """Bytes a decode step must move (the roofline denominator used by bench/).

    K and V: sum(context_lens) x num_kv_heads x head_size x dtype_bytes x 2;
    query read + output write: num_seqs x num_heads x head_size x dtype_bytes x 2;
    block tables/lengths ignored; split adds fp32 partials written then read:
    2 x num_seqs x num_heads x partitions x (head_size + 2) x 4.
    """
    n = len(context_lens)
    kv = 2 * sum(context_lens) * num_kv_heads * head_size * dtype_bytes
    qo = 2 * n * num_heads * head_size * dtype_bytes
    part = 0 if partitions <= 1 else 2 * n * num_heads * partitions * (head_size + 2) * 4
    return kv + qo + part


def cache_write_bytes(num_tokens: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
    """Bytes ``reshape_and_cache`` moves: K and V read and written, plus 8-byte slots."""
    return 4 * num_tokens * num_kv_heads * head_size * dtype_bytes + 8 * num_tokens
