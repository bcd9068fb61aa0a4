"""CUDA implementations of the two kernel ops (CuPy RawModule launches).

Takes torch CUDA tensors, hands them to CuPy zero-copy through DLPack (16-bit
types viewed as int16 so CuPy never needs a bfloat16 dtype) and launches on
torch's current CUDA stream. Importing this module needs neither CuPy nor a GPU;
CuPy is imported on the first launch (``inflight_kernels.cuda.build.get_module``).
Signatures are fixed by docs/CONTRACTS.md.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from inflight_kernels.cuda import build, launch

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _require(cond: bool, msg: str, exc: type[Exception] = ValueError) -> None:
    if not cond:
        raise exc(msg)


def _check_tensor(name: str, t, ndim: int, dtype, device) -> None:
    _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    _require(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}", TypeError)
    _require(t.device == device, f"{name} is on {t.device}, expected {device}")
    _require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    _require(t.is_contiguous(), f"{name} must be contiguous")


def _check_cache_pair(key_cache, value_cache, dtype, device) -> tuple[int, int, int, int]:
    _check_tensor("key_cache", key_cache, 4, dtype, device)
    _check_tensor("value_cache", value_cache, 4, dtype, device)
    _require(key_cache.shape == value_cache.shape,
             f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ")
    return tuple(key_cache.shape)


def _dtype_name(dtype) -> str:
    _require(dtype in _DTYPE_NAMES, f"unsupported dtype {dtype}; supported: {list(_DTYPE_NAMES)}", TypeError)
    return _DTYPE_NAMES[dtype]


def _as_cupy(t: torch.Tensor):
    """Zero-copy CuPy view of a CUDA tensor (call inside the launch stream's context)."""
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    return build.import_cupy().from_dlpack(t)


@functools.lru_cache(maxsize=None)
def device_limits(index: int) -> tuple[int, int]:
    """(SM count, opt-in shared memory bytes per block) of CUDA device ``index``: the two
    device figures :func:`inflight_kernels.cuda.launch.plan_attention` takes after the
    shapes, so a caller (bench/gpu_kernels.py) can see the plan :func:`paged_attention` runs.

    Raises:
        ImportError: CuPy is not installed; cupy.cuda.runtime.CUDARuntimeError: no such device.
    """
    cupy = build.import_cupy()
    attrs = cupy.cuda.Device(index).attributes
    return attrs["MultiProcessorCount"], attrs["MaxSharedMemoryPerBlockOptin"]


def _launch(kernel, grid, block, args, smem_bytes: int) -> None:
    if smem_bytes > launch.DEFAULT_SMEM_BYTES and kernel.max_dynamic_shared_size_bytes < smem_bytes:
        kernel.max_dynamic_shared_size_bytes = smem_bytes
    kernel(grid, block, args, shared_mem=smem_bytes)


class _on_torch_stream:
    """Context: CuPy's current device and stream = torch's for ``device``."""

    def __init__(self, device: torch.device):
        cupy = build.import_cupy()
        self._dev = cupy.cuda.Device(device.index)
        self._stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)

    def __enter__(self):
        self._dev.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        self._dev.__exit__(*exc)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write new K/V rows into the paged cache in place (CUDA).

    key, value: [num_tokens, num_kv_heads, head_dim], fp16/bf16/fp32, CUDA, contiguous.
    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim], same dtype/device.
    slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset; negative = skipped.
    Slots are not bounds-checked on the device (that would need a sync): callers own them.
    Moves 4 * num_tokens * num_kv_heads * head_dim * itemsize + 8 * num_tokens bytes.
    Raises TypeError (not a tensor, wrong dtype), ValueError (shape, device,
    contiguity, unsupported size), ImportError (no CuPy).
    Source: the KV write of vLLM (Kwon et al., SOSP'23).
    """
    _require(isinstance(key, torch.Tensor), "key must be a torch.Tensor", TypeError)
    dtype, device = key.dtype, key.device
    _require(device.type == "cuda", f"key is on {device}; cuda_ops needs CUDA tensors")
    _check_tensor("key", key, 3, dtype, device)
    name = _dtype_name(dtype)
    _check_tensor("value", value, 3, dtype, device)
    _require(value.shape == key.shape, f"value {tuple(value.shape)} differs from key {tuple(key.shape)}")
    num_blocks, num_kv_heads, block_size, head_dim = _check_cache_pair(key_cache, value_cache, dtype, device)
    _require(key.shape[1:] == (num_kv_heads, head_dim),
             f"key {tuple(key.shape)} does not match cache heads/head_dim {(num_kv_heads, head_dim)}")
    _check_tensor("slot_mapping", slot_mapping, 1, torch.int64, device)
    _require(slot_mapping.shape[0] == key.shape[0], "slot_mapping must have one slot per token")
    if key.shape[0] == 0:
        return
    module = build.get_module("reshape_and_cache", name, head_dim, block_size, device.index)
    kernel = module.get_function(build.kernel_names("reshape_and_cache", name, head_dim, block_size)["main"])
    grid, block = launch.plan_reshape_and_cache(key.shape[0])
    with _on_torch_stream(device):
        args = tuple(_as_cupy(t) for t in (key, value, key_cache, value_cache, slot_mapping))
        _launch(kernel, grid, block, args + (np.int32(num_kv_heads),), 0)


def _check_attention(query, key_cache, value_cache, block_tables, context_lens, out):
    _require(isinstance(query, torch.Tensor), "query must be a torch.Tensor", TypeError)
    dtype, device = query.dtype, query.device
    _require(device.type == "cuda", f"query is on {device}; cuda_ops needs CUDA tensors")
    _check_tensor("query", query, 3, dtype, device)
    _, num_kv_heads, block_size, head_dim = _check_cache_pair(key_cache, value_cache, dtype, device)
    num_seqs, num_heads, q_dim = query.shape
    _require(q_dim == head_dim, f"query head_dim {q_dim} != cache head_dim {head_dim}")
    _require(num_heads % num_kv_heads == 0, f"num_heads={num_heads} not a multiple of num_kv_heads={num_kv_heads}")
    _check_tensor("block_tables", block_tables, 2, torch.int32, device)
    _check_tensor("context_lens", context_lens, 1, torch.int32, device)
    _require(block_tables.shape[0] == num_seqs and context_lens.shape[0] == num_seqs,
             "block_tables and context_lens need one row per sequence")
    if out is not None:
        _check_tensor("out", out, 3, dtype, device)
        _require(out.shape == query.shape, f"out {tuple(out.shape)} must match query {tuple(query.shape)}")
    return _dtype_name(dtype), num_kv_heads, block_size, head_dim


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out=None):
    """Decode attention of one query token per sequence over the paged KV cache (CUDA).

    query: [num_seqs, num_heads, head_dim] fp16/bf16/fp32; key_cache, value_cache:
    [num_blocks, num_kv_heads, block_size, head_dim] same dtype; block_tables:
    [num_seqs, max_blocks_per_seq] int32; context_lens: [num_seqs] int32 (tokens
    attended, clamped to max_blocks_per_seq * block_size; 0 gives a zero output);
    scale: float multiplying q.k; out: optional tensor like query. Returns out.
    num_heads % num_kv_heads == 0 (GQA): one thread block per KV head reads each
    page once for its whole query-head group. Bytes moved: see
    ``inflight_kernels.cuda.launch.attention_bytes``. Raises TypeError/ValueError on bad
    dtypes/shapes/devices/contiguity, ImportError without CuPy.
    Sources: vLLM paged attention (Kwon et al., SOSP'23), Flash-Decoding (Dao et
    al., 2023) for the split variant, online softmax (Milakov & Gimelshein, 2018).
    """
    name, num_kv_heads, block_size, head_dim = _check_attention(
        query, key_cache, value_cache, block_tables, context_lens, out)
    out = torch.empty_like(query) if out is None else out
    if query.shape[0] == 0:
        return out
    device = query.device
    sms, smem_limit = device_limits(device.index)
    plan = launch.plan_attention(query.shape[0], query.shape[1], num_kv_heads, head_dim, block_size,
                                 block_tables.shape[1], query.element_size(), sms, smem_limit)
    module = build.get_module("paged_attention", name, head_dim, block_size, device.index)
    names = build.kernel_names("paged_attention", name, head_dim, block_size)
    with _on_torch_stream(device):
        _run_attention(module, names, plan, query, key_cache, value_cache, block_tables,
                       context_lens, float(scale), out)
    return out


def _run_attention(module, names, plan, query, key_cache, value_cache, block_tables, context_lens,
                   scale, out) -> None:
    num_seqs, num_heads, head_dim = query.shape
    parts_shape = (num_seqs, num_heads, plan.num_partitions)
    if plan.split:
        sums = torch.empty(parts_shape, dtype=torch.float32, device=query.device)
        maxes = torch.empty_like(sums)
        partial = torch.empty(parts_shape + (head_dim,), dtype=torch.float32, device=query.device)
    else:
        sums = maxes = partial = out  # unused by the single-pass branch
    c = _as_cupy
    gqa = num_heads // key_cache.shape[1]
    args = (c(out), c(sums), c(maxes), c(partial), c(query), c(key_cache), c(value_cache),
            c(block_tables), c(context_lens), np.float32(scale), np.int32(gqa),
            np.int32(block_tables.shape[1]), np.int32(plan.partition_size))
    _launch(module.get_function(names["main"]), plan.grid, plan.block, args, plan.smem_bytes)
    if plan.split:
        rargs = (c(out), c(sums), c(maxes), c(partial), c(context_lens), np.int32(plan.num_partitions),
                 np.int32(plan.partition_size), np.int32(plan.max_context))
        _launch(module.get_function(names["reduce"]), plan.reduce_grid, plan.block, rargs,
                plan.reduce_smem_bytes)
