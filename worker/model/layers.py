"""Stateless building blocks of the Llama decoder's torch path: RMSNorm, RoPE
and SwiGLU are the kernels' torch reference (:mod:`kernels.reference`, written
once there: the compiled CPU ops are checked against them), the RoPE tables are
computed here."""

from __future__ import annotations

import torch

from kernels.reference import apply_rope, rms_norm, silu_mul

__all__ = ["apply_rope", "rms_norm", "rope_cos_sin", "silu_mul"]


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
