"""The hardware ceiling, measured in the same run as the benchmark.

* Compute: FLOP/s of a large square matrix product in the benchmark's dtype
  (``2 n^3`` FLOPs per ``n x n @ n x n``), best of a few repeats. With int8
  weights and activations (``--quantization q8_0``) the dtype is int8 and the
  product is a library one, ``torch._int_mm`` (int8 x int8 -> int32, oneDNN on
  the CPU), so the ceiling is the machine's, not our kernel's.
* Memory: bandwidth of a large tensor copy, bytes/s, counting the bytes read
  plus the bytes written (STREAM "copy" convention, McCalpin).

Turned into tokens/s for a decoder with ``P`` parameters (Kaplan et al. 2020:
about ``2 P`` FLOPs per generated token) and ``W`` weight bytes:

* compute bound: ``FLOP/s / (2 P)`` tokens/s, whatever the batch size;
* memory bound: a decode step reads every weight once, so at batch ``B``
  ``B * bandwidth / W`` tokens/s;
* ceiling = min of the two (the roofline, Williams et al. CACM 2009).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

import inflight_kernels

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Hardware:
    """Measured peaks. matmul_flops in FLOP/s (dtype, size n); bandwidth in bytes/s."""

    dtype: str
    matmul_n: int
    matmul_flops: float
    bandwidth: float


@dataclass(frozen=True)
class ModelCost:
    """params: parameters (tied embeddings counted once); weight_bytes: bytes read per decode step."""

    params: int
    weight_bytes: int


@dataclass(frozen=True)
class Ceiling:
    """Tokens/s ceilings at one batch size (tokens/s)."""

    compute_tok_s: float
    memory_tok_s: float

    @property
    def tok_s(self) -> float:
        """The roofline: min(compute, memory) tokens/s."""
        return min(self.compute_tok_s, self.memory_tok_s)


def best_seconds(fn, repeats: int, device: torch.device = CPU) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up, seconds; on a GPU
    each call is timed to the end of its kernels (``torch.cuda.synchronize``)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up (allocations, kernel selection)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: torch.device = CPU) -> float:
    """FLOP/s of ``n x n @ n x n`` in ``dtype`` on ``device`` (2 n^3 FLOPs per product;
    for ``torch.int8``, integer multiply-adds counted alike: the faster of ``torch._int_mm``
    and, on a CPU with the compiled kernels, our Q8_0 GEMM (``inflight_kernels/cpu/q8_gemm.cpp``),
    which the quantized models run; on an AVX2-only EPYC torch's int8 product made
    1 GOP/s, a ceiling 100x below what the model reached).

    Raises:
        RuntimeError: this torch build has no int8 product on ``device``.
    """
    if dtype == torch.int8:
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        products = [lambda: torch._int_mm(a, b)]
        if device.type == "cpu" and inflight_kernels.cpu_kernels_available():
            x = torch.randn(n, n)
            packed, scales = inflight_kernels.q8_pack_weight(torch.randn(n, n))
            products.append(lambda: inflight_kernels.q8_linear(x, packed, scales, n))
    else:
        a = torch.randn(n, n).to(device=device, dtype=dtype)
        b = torch.randn(n, n).to(device=device, dtype=dtype)
        products = [lambda: torch.mm(a, b)]
    with torch.inference_mode():
        seconds = min(best_seconds(product, repeats, device) for product in products)
    return 2.0 * n ** 3 / seconds


def measure_bandwidth(nbytes: int = 256 * 2 ** 20, repeats: int = 5, device: torch.device = CPU) -> float:
    """Bytes/s of copying an ``nbytes`` tensor into another on ``device`` (read + write = 2 nbytes)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), repeats, device)
    return 2.0 * nbytes / seconds


def matmul_dtype(dtype: torch.dtype, quantization: str) -> torch.dtype:
    """The dtype whose products bound a model computing in ``dtype`` with weights
    quantized as ``quantization`` (``"none"``, ``"q8_0"`` or ``"q4_1"``): int8 for q8_0
    and q4_1, whose GEMMs multiply int8 activations by int8 or 4-bit weights
    (``inflight_kernels/cpu/q8_gemm.cpp``, ``q4_gemm.cpp``), else ``dtype``."""
    return torch.int8 if quantization != "none" else dtype


def measure(dtype: torch.dtype, n: int = 2048, nbytes: int = 256 * 2 ** 20, device: torch.device = CPU) -> Hardware:
    """Both peaks, for the benchmark's dtype, on the device the model runs on
    (``--ceiling-n 8192`` suits a GPU: a 2048 product leaves most of it idle)."""
    return Hardware(str(dtype).removeprefix("torch."), n, measure_matmul_flops(dtype, n, device=device),
                    measure_bandwidth(nbytes, device=device))


def ceiling(hw: Hardware, cost: ModelCost, batch: float) -> Ceiling:
    """Tokens/s ceilings for decoding ``batch`` sequences per step."""
    return Ceiling(hw.matmul_flops / (2.0 * cost.params), max(batch, 1.0) * hw.bandwidth / cost.weight_bytes)


def _weights(model) -> list:
    tensors = [model.embed, model.norm] + ([] if model.tied_lm_head else [model.lm_head])
    for layer in model.layers:
        tensors += [v for v in vars(layer).values() if v is not None and hasattr(v, "shape")]
    return tensors


def count_params(model) -> int:
    """Parameters of a :class:`worker.model.llama.LlamaDecoder` (tied embeddings count once;
    prepacked or quantized weights, which have no data pointer, count by their shape)."""
    return sum(math.prod(t.shape) for t in _weights(model))


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every projection, the norms and the lm_head
    as held (a quantized lm_head by its own bytes, the embedding rows looked up aside; GGUF
    blocks by the blocks' bytes, not their dense copies, which only steps of many rows read)."""
    from worker.model.kquant import KQuantWeight
    from worker.model.linear import BF16Weight
    from worker.model.block_weights import Q4Weight, Q8Weight

    held = [t for t in _weights(model) if t is not model.embed and t is not model.lm_head] + [model.lm_head]
    return sum(t.block_nbytes if isinstance(t, (Q8Weight, Q4Weight, KQuantWeight))
               else t.nbytes if isinstance(t, BF16Weight)
               else math.prod(t.shape) * t.element_size() for t in held)
