"""Rotary position embeddings (Su et al. 2021, "RoFormer") and their context-extension
scalings: linear position interpolation (Chen et al. 2023), dynamic NTK (the
"NTK-aware" base change, bloc97 2023), YaRN (Peng et al. 2023), Llama 3.1's
frequency-band scaling (``llama3``, Meta's reference code) and Phi-3's LongRoPE
(Ding et al. 2024). The formulas are those of transformers'
``modeling_rope_utils`` (the oracle the tests compare against), written here
from the papers' definitions.

``dynamic`` depends on the sequence's length, as in transformers: the base grows
once a sequence passes ``max_position_embeddings``. transformers takes that length
as the largest position of the forward call; here it is each token's own
sequence's length at the end of its chunk, so a sequence's frequencies do not
depend on what else is in the batch (for one sequence alone the two agree). vLLM's
dynamic NTK instead fixes the base for the whole extended context; we follow
transformers, the oracle.

``longrope`` picks its factor set once, as vLLM does: the long factors when the
served context (``max_position_embeddings``) exceeds
``original_max_position_embeddings``, else the short ones. transformers uses
the short set while a sequence is within the original context and, when it
grows past it, recomputes the whole sequence's cache with the long set
(``Phi3ForCausalLM.prepare_inputs_for_generation``); a paged cache shared by a
batch cannot re-prefill mid-stream, so the two agree once a sequence is longer
than the original context (Phi-3.5: 4096 tokens) and differ below it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding.

    Attributes:
        theta: base frequency.
        rope_type: one of :data:`SUPPORTED_ROPE_TYPES`.
        factor: context extension factor (linear, dynamic, yarn, llama3; longrope
            derives its own from the two lengths when None).
        max_position_embeddings: the model's (extended) context, in tokens.
        original_max_position_embeddings: the pre-extension context (yarn,
            llama3, longrope).
        low_freq_factor, high_freq_factor: llama3's band edges.
        beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate: YaRN's
            (``attention_factor`` also LongRoPE's).
        short_factor, long_factor: LongRoPE's per-frequency divisors, ``head_dim / 2`` each.
        freq_factors: per-frequency divisors of the default RoPE, ``head_dim / 2``
            (llama.cpp's ``rope_freqs`` tensor: how Llama 3.1 GGUF files carry
            their llama3 scaling); empty = none.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    max_position_embeddings: int = 2048
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"RoPE type {self.rope_type!r} unsupported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if self.rope_type in ("linear", "dynamic", "yarn", "llama3") and not self.factor:
            raise ValueError(f"RoPE type {self.rope_type!r} needs a factor")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("RoPE type 'longrope' needs short_factor and long_factor")

    @property
    def original_context(self) -> int:
        """``original_max_position_embeddings``, else ``max_position_embeddings``."""
        return self.original_max_position_embeddings or self.max_position_embeddings

    @property
    def length_dependent(self) -> bool:
        """True when the frequencies depend on the sequence's length (dynamic)."""
        return self.rope_type == "dynamic"


def rope_config(params: dict | None, theta: float, max_position_embeddings: int,
                original_max_position_embeddings: int | None = None) -> RopeConfig:
    """:class:`RopeConfig` from a transformers ``rope_scaling`` / ``rope_parameters`` dict
    (v4 ``type`` or v5 ``rope_type``; None = default RoPE).

    Raises:
        ValueError: an unsupported RoPE type (the message names the supported ones)
            or missing parameters.
    """
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type")) or "default"
    original = params.get("original_max_position_embeddings", original_max_position_embeddings)
    optional = {key: params[key] for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                                             "mscale_all_dim", "attention_factor", "truncate")
                if params.get(key) is not None}
    return RopeConfig(
        theta=float(params.get("rope_theta", theta)), rope_type=kind,
        factor=float(params["factor"]) if params.get("factor") is not None else None,
        max_position_embeddings=int(max_position_embeddings),
        original_max_position_embeddings=int(original) if original else None,
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
        **optional)


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    """``1 / theta^(2i/dim)``, ``[dim/2]`` float32 (theta may be ``[N, 1]``: then ``[N, dim/2]``)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta**exponents)


def inv_freq(rope: RopeConfig, dim: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim/2]`` float32 and the cos/sin multiplier of a
    length-independent ``rope`` (longrope: the long factors when the served
    context exceeds the original one, or with ``long``).

    Raises:
        ValueError: dynamic RoPE (its frequencies depend on the length: :func:`rope_cos_sin`).
    """
    kind = rope.rope_type
    base = _base_inv_freq(rope.theta, dim)
    if kind == "default":
        return (base / torch.tensor(rope.freq_factors, dtype=torch.float32) if rope.freq_factors else base), 1.0
    if kind == "linear":
        return base / rope.factor, 1.0
    if kind == "llama3":
        return _llama3(base, rope), 1.0
    if kind == "yarn":
        return _yarn(rope, dim)
    if kind == "longrope":
        return _longrope(rope, dim, long or rope.max_position_embeddings > rope.original_context)
    raise ValueError(f"RoPE type {kind!r} has length-dependent frequencies")


def _llama3(base: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: wavelengths beyond ``original / low_freq_factor`` divided by
    ``factor``, below ``original / high_freq_factor`` kept, smoothly mixed between."""
    old = rope.original_context
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / rope.factor, base)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    mixed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, mixed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, a linear ramp
    between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the
    original context; cos/sin scaled by ``0.1 ln(factor) + 1`` (or the mscale ratio)."""
    factor = rope.factor or rope.max_position_embeddings / rope.original_context

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.attention_factor
    if attention is None:
        attention = (mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
                     if rope.mscale and rope.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def _longrope(rope: RopeConfig, dim: int, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE: ``1 / (ext_i * theta^(2i/dim))`` with the short or long factors;
    cos/sin scaled by ``sqrt(1 + ln(s) / ln(original))``, ``s = max / original``."""
    factors = rope.long_factor if long else rope.short_factor
    if len(factors) != dim // 2:
        raise ValueError(f"longrope needs {dim // 2} factors, got {len(factors)}")
    factor = rope.factor or rope.max_position_embeddings / rope.original_context
    attention = rope.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(rope.original_context))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents), float(attention)


def rope_cos_sin(rope: RopeConfig, head_dim: int, positions: torch.Tensor, seq_lens: torch.Tensor | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[num_tokens, head_dim]`` in ``dtype`` (HF layout: frequencies repeated
    for both halves; computed in float32, times the scaling's attention factor).

    Args:
        positions: ``[num_tokens]`` int64 absolute positions.
        seq_lens: ``[num_tokens]`` int64, each token's sequence length at the end of
            its chunk (dynamic only; None: ``positions + 1``).
    """
    if rope.length_dependent:
        freqs, scale = _length_dependent(rope, head_dim, positions, positions + 1 if seq_lens is None else seq_lens)
    else:
        inv, scale = inv_freq(rope, head_dim)
        freqs = positions.float()[:, None] * inv.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def _length_dependent(rope: RopeConfig, dim: int, positions: torch.Tensor,
                      seq_lens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-token angles ``[N, dim/2]`` for dynamic NTK, and the cos/sin multiplier."""
    lens = seq_lens.to(positions.device)
    top = rope.max_position_embeddings
    grown = lens.clamp(min=top).float()  # float32, as transformers computes it
    base = rope.theta * ((rope.factor * grown / top) - (rope.factor - 1)) ** (dim / (dim - 2))
    inv = torch.where((lens > top)[:, None], _base_inv_freq(base[:, None].float(), dim),
                      _base_inv_freq(rope.theta, dim)[None, :])
    return positions.float()[:, None] * inv, 1.0
