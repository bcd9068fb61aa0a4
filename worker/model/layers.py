"""Stateless building blocks of the Llama decoder: RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as in HF ``LlamaRMSNorm``: statistics in
    float32, result cast back to ``x.dtype`` before the weight multiply.

    Args:
        x: ``[num_tokens, hidden]``; weight: ``[hidden]``.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, heads, head_dim]`` with HF's ``rotate_half``
    convention (NeoX style: first half paired with second half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up`` from the fused
    ``[num_tokens, 2 * intermediate]`` gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
