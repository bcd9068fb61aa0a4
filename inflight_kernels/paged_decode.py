"""Decode attention over the paged KV cache as one call for the model (:func:`decode_attention`),
with every choice of path made here: the compiled kernel wherever one takes the shapes
(:func:`inflight_kernels.attention_backend`: CUDA, or the compiled CPU kernel, with a float32
query rounded to a bfloat16 cache's precision where the CPU kernel has ``vdpbf16ps``);
elsewhere the torch paths: :func:`inflight_kernels.paged_attention`'s reference (float32,
even lengths), :func:`padded_lowp_decode_attention` (bf16/fp16, even lengths) or the
padding-free :mod:`inflight_kernels.varlen_attention` (mixed lengths, :func:`use_varlen`).
:func:`decode_plan` builds the varlen plan once per step where that path will run;
:func:`prefill_as_decode` runs a prefill chunk through the compiled CPU decode kernel where
it takes the shapes, so a row's result does not depend on the chunk (batch invariance)."""

from __future__ import annotations

import torch

from inflight_kernels.dispatch import attention_backend, cpu_bf16_dot, paged_attention
from inflight_kernels.varlen_attention import VarlenPlan, build_varlen_plan, varlen_decode_attention

# Rule for the CPU decode path, from bench/decode_attention.py (see decode_attention).
VARLEN_MIN_WASTE = 1.3
VARLEN_CHUNK_BLOCKS = 1


def use_varlen(context_lens: torch.Tensor, block_size: int) -> bool:
    """True when the padding-free path is the default for these lengths:
    ``S * max_len / Σ ctx >= VARLEN_MIN_WASTE`` (padded tokens over tokens
    attended; lengths rounded up to whole blocks). ``context_lens``: ``[S]`` int."""
    if not context_lens.numel():
        return False
    blocks = (context_lens.long() + block_size - 1) // block_size
    used = int(blocks.sum())
    return used > 0 and context_lens.numel() * int(blocks.max()) >= VARLEN_MIN_WASTE * used


def decode_plan(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor) -> VarlenPlan | bool:
    """The varlen plan of a step's decode rows when :func:`decode_attention` will take the
    padding-free path for them (no compiled kernel for these shapes, and :func:`use_varlen`),
    else False (the padded path or a compiled kernel). ``query`` ``[num_decodes, num_heads,
    head_dim]``, ``key_cache`` ``[num_blocks, num_kv_heads, block_size, head_dim]``,
    ``block_tables`` ``[num_decodes, max_blocks]`` int32, ``context_lens`` ``[num_decodes]`` int32."""
    block_size = key_cache.shape[2]
    if attention_backend(query, key_cache) == "reference" and use_varlen(context_lens, block_size):
        return build_varlen_plan(block_tables, context_lens, block_size, VARLEN_CHUNK_BLOCKS)
    return False


def prefill_as_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, start_pos: int, scale: float,
                      sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor | None:
    """Causal attention of a prefill chunk ``q`` ``[n, num_heads, head_dim]`` (positions
    ``start_pos ..``, its K/V already written to the pages of ``block_table`` ``[num_blocks]``)
    computed row by row as decodes of context ``start_pos + i + 1`` by the compiled CPU kernel,
    where it takes these shapes; None elsewhere (the caller runs its own prefill attention).

    Why: the kernel computes each (row, kv head) alone on one thread, so a row's output depends
    on its query and the cached K/V only, not on how many rows share the chunk; SDPA's softmax
    reductions run over the chunk's key span, and a prefix-cache hit recomputing the last 3 of
    51 prompt tokens once moved a bfloat16 attention output by one ulp and flipped the first
    greedy token (issue 24 item 5)."""
    if attention_backend(q, key_cache) != "cpu":
        return None
    n = q.shape[0]
    tables = block_table.to(torch.int32)[None].expand(n, -1).contiguous()
    lens = torch.arange(start_pos + 1, start_pos + n + 1, dtype=torch.int32, device=q.device)
    q = q.contiguous()
    return decode_attention(q, key_cache, value_cache, tables, lens, scale, out=torch.empty_like(q), plan=False,
                            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out: torch.Tensor, plan: VarlenPlan | bool | None = None,
                     sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Decode attention, same contract as :func:`inflight_kernels.paged_attention`, on the
    fastest path for the shapes: the one call the model makes.

    A sliding window or soft-cap (Mistral, Gemma 2/3) always goes to
    ``inflight_kernels.paged_attention``, which takes both (compiled CPU kernel or the
    torch reference); the varlen and low-precision torch paths below do not.

    ``inflight_kernels.paged_attention`` wherever it runs a compiled kernel
    (:func:`inflight_kernels.attention_backend` is "cuda" or "cpu"; on the CPU float32
    scores and softmax, no padding; faster than the torch paths below at
    SmolLM2-135M shapes, ``bench/decode_attention.py``, bench/RESULTS.md, "Measurements first recorded in docstrings").
    A float32 query over a bfloat16 cache (``--quantization q8_0``'s default
    cache on a CPU with AVX-512 BF16) is rounded to bfloat16 first, the
    precision the cache holds K and V in, so the CPU kernel's ``vdpbf16ps``
    path runs (:func:`inflight_kernels.cpu_bf16_dot`); the output is widened back.
    Otherwise (the "reference" backend) the path depends on how uneven the
    context lengths are (:func:`use_varlen`):

    * padding waste ``S * max_len / Σ ctx`` below ``VARLEN_MIN_WASTE``: the
      padded paths, ``inflight_kernels.paged_attention`` for float32 caches (the
      reference numerics) and :func:`padded_lowp_decode_attention` for bf16/fp16
      (no float32 cast of the pages; faster in bf16, bench/RESULTS.md, "Measurements first recorded in docstrings");
    * otherwise :func:`inflight_kernels.varlen_attention.varlen_decode_attention`,
      whose work is proportional to Σ ctx, not ``S * max_len``.

    Measured (``bench/decode_attention.py``, bf16 cache, SmolLM2-135M shapes,
    one layer, medians of 41 alternating runs, 2 cores, AMD EPYC with
    AVX-512 BF16; padded ms -> varlen ms, speed-up):

    ===  ================  =====  ==================  =====
    S    lengths           waste  padded -> varlen    x
    ===  ================  =====  ==================  =====
    8    all 512           1.0    0.57 -> 0.75        0.75
    32   all 512           1.0    3.67 -> 3.72        0.99
    64   all 512           1.0    6.12 -> 5.86        1.04
    8    random 16..1024   2.96   1.37 -> 0.78        1.76
    32   random 16..1024   2.33   8.69 -> 4.17        2.08
    64   random 16..1024   2.02   14.2 -> 6.55        2.17
    8    1000 + 7 x 40     6.3    1.42 -> 0.58        2.45
    32   1000 + 31 x 40    14.4   5.83 -> 1.00        5.86
    64   1000 + 63 x 40    18.3   11.4 -> 1.44        7.92
    ===  ================  =====  ==================  =====

    With even lengths varlen is at best even (its many small per-block
    matmuls cost about what padding saves), and 25% slower at S=8, hence the
    threshold 1.3 ~ 1 / 0.75. The plan costs 0.2-0.4 ms once per step.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int32; context_lens: ``[num_seqs]`` int32.
        out: ``[num_seqs, num_heads, head_dim]`` output buffer, filled and returned.
        plan: None = choose here (building the plan if varlen is chosen);
            False = the padded path; a :class:`VarlenPlan` of this batch = the
            varlen path with it (built once per step, see
            :func:`decode_plan`; :meth:`worker.model.attention.AttentionMetadata.decode_plan`).
    """
    backend = attention_backend(query, key_cache)
    masked = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    if (backend == "cpu" and query.dtype == torch.float32 and key_cache.dtype == torch.bfloat16
            and cpu_bf16_dot()):
        rounded = query.to(torch.bfloat16)  # to the cache's precision: the vdpbf16ps path
        out.copy_(paged_attention(rounded, key_cache, value_cache, block_tables, context_lens, scale,
                                  out=torch.empty_like(rounded), **masked))
        return out
    if backend != "reference" or sliding_window or logits_soft_cap:  # compiled (CUDA, CPU), or masked
        return paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out=out, **masked)
    if plan is None and use_varlen(context_lens, key_cache.shape[2]):
        plan = build_varlen_plan(block_tables, context_lens, key_cache.shape[2], VARLEN_CHUNK_BLOCKS)
    if isinstance(plan, VarlenPlan):
        return varlen_decode_attention(query, key_cache, value_cache, plan, scale, out)
    if key_cache.dtype == torch.float32:
        return paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out=out)
    return padded_lowp_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, out)


def padded_lowp_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                 out: torch.Tensor) -> torch.Tensor:
    """Paged decode attention with the pages gathered once in the cache dtype.

    Numerics of HF ``LlamaAttention`` eager in bf16/fp16: ``q K^T`` and
    ``P V`` are matmuls in the cache dtype (float32 accumulation inside the
    kernel, result rounded to the cache dtype); scale, mask and softmax in
    float32, probabilities rounded to the cache dtype before ``P V``. Rows
    with context 0 yield zeros. Shapes as in :func:`decode_attention`.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    used_blocks = max(1, -(-int(context_lens.max()) // block_size))
    tables = block_tables[:, :used_blocks].long()
    keys = _gather_pages_native(key_cache, tables)  # [S, KVH, L, D] cache dtype
    values = _gather_pages_native(value_cache, tables)
    q = query.to(key_cache.dtype).view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale)  # [S, KVH, G, L] float32
    beyond = torch.arange(keys.shape[2], device=query.device)[None, :] >= context_lens.long()[:, None]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(values.dtype)
    out.copy_(torch.matmul(probs, values).view(num_seqs, num_heads, head_dim))
    return out


def _gather_pages_native(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``[S, KVH, blocks*block_size, D]`` copy of each sequence's pages
    (``tables`` ``[S, blocks]`` int64), in the cache dtype. ``index_select``
    of whole blocks from a 2-D view, then one transposing copy (faster than
    ``cache[tables]``: bench/RESULTS.md, "Measurements first recorded in docstrings")."""
    s, b = tables.shape
    _, kvh, bs, d = cache.shape
    pages = cache.view(cache.shape[0], -1).index_select(0, tables.reshape(-1)).view(s, b, kvh, bs, d)
    return pages.transpose(1, 2).reshape(s, kvh, b * bs, d)
