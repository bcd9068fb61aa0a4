"""Stateless building blocks of the Llama decoder's torch path: RMSNorm, RoPE
and SwiGLU are the kernels' torch reference (:mod:`inflight_kernels.reference`, written
once there: the compiled CPU ops are checked against them), the default RoPE
tables (scaled ones: :mod:`worker.model.rope`), Gemma's RMSNorm and GELU gate
are computed here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inflight_kernels.reference import apply_rope, rms_norm, silu_mul

__all__ = ["apply_rope", "gelu_tanh_mul", "gemma_rms_norm", "rms_norm", "rope_cos_sin", "silu_mul"]


def gemma_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (HF ``Gemma2RMSNorm``/``Gemma3RMSNorm``): statistics and the
    multiply by ``1 + w`` in float32, then one cast to ``x.dtype`` (Llama casts before
    the multiply).

    Args:
        x: ``[..., dim]`` any float dtype.
        weight_plus_one: ``[dim]`` float32, ``1 + w`` (w rounded to the model dtype first).

    Returns:
        A new tensor like ``x``.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight_plus_one).to(x.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``):
    ``gelu(gate) * up`` of ``gate_up`` ``[num_tokens, 2 * inter]``; a new
    ``[num_tokens, inter]`` tensor in the same dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[num_tokens, head_dim]`` for rotary embeddings (Su et al. 2021),
    HF layout (frequencies repeated for both halves), computed in float32.

    Args:
        positions: ``[num_tokens]`` int64 absolute positions.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
