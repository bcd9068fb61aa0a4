"""Batched token sampling: greedy, temperature, top-k, top-p, per-request
seeds and logprobs, vectorized over the rows of one logits tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a sampled token, and of the top alternatives.

    Attributes:
        token_id: the sampled token.
        logprob: its natural-log probability under the model's raw
            distribution (before temperature/top-k/top-p).
        top: up to ``SamplingParams.logprobs`` (token_id, logprob) pairs, most
            likely first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplerOutput:
    """Attributes:
        token_ids: one sampled token per row, Python ints.
        logprobs: per row a TokenLogprob, or None where not requested.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def seed_for_step(seed: int, output_index: int) -> int:
    """64-bit generator seed for draw number ``output_index`` of a request
    seeded with ``seed`` (splitmix64 finalizer, Steele et al. OOPSLA'14), so a
    seeded draw depends only on (seed, index), never on batch neighbours."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Samples one token per row of a logits batch.

    Non-greedy rows use the exponential race (Gumbel-max equivalent): the
    token is ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` i.i.d., which draws
    ``i`` with probability ``p_i``. Seeded rows draw their ``E`` from a
    generator seeded by :func:`seed_for_step`; unseeded rows share one batched
    draw from ``generator`` (or torch's default generator).

    Args:
        generator: optional torch.Generator for unseeded rows (tests).
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int]) -> SamplerOutput:
        """Sample a token per row.

        Args:
            logits: [B, vocab] float32 (any device).
            params: B sampling parameters, one per row.
            output_indices: B ints: index in the request's output of the token
                being sampled (0 for the first generated token).

        Returns:
            SamplerOutput with B token ids.

        Raises:
            ValueError: if the lengths of logits, params and indices differ.
        """
        if not (logits.shape[0] == len(params) == len(output_indices)):
            raise ValueError(f"rows mismatch: logits {tuple(logits.shape)}, {len(params)} params, {len(output_indices)} indices")
        if logits.shape[0] == 0:
            return SamplerOutput([], [])
        logits = logits.float()
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
        greedy = temps == 0
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, temps, greedy, params, output_indices)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(logits, tokens, params))

    def _sample(self, logits: torch.Tensor, temps: torch.Tensor, greedy: torch.Tensor,
                params: list[SamplingParams], output_indices: list[int]) -> torch.Tensor:
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
        scaled = _apply_top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, (p, idx) in enumerate(zip(params, output_indices)):
            if p.seed is not None and p.temperature > 0:
                g = torch.Generator(device=probs.device).manual_seed(seed_for_step(p.seed, idx))
                noise[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p
    nucleus (Holtzman et al. ICLR'20). logits: [B, V] float32; returns a new
    tensor. The most likely token always survives. When every row has a
    top-k, only the ``max(top_k)`` best are sorted (``topk``), not the vocab."""
    vocab = logits.shape[1]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if all(k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    k_max = max(top_k)
    if k_max < vocab:
        sorted_logits, order = logits.topk(k_max, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(sorted_logits.shape[1], device=logits.device).unsqueeze(0)
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, dtype=torch.float32, device=logits.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list[TokenLogprob | None]:
    if not any(p.wants_logprobs for p in params):
        return [None] * len(params)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    n = max(p.logprobs for p in params)
    top_vals, top_ids = (logp.topk(n, dim=-1) if n > 0 else (None, None))
    out: list[TokenLogprob | None] = []
    tok = tokens.tolist()
    for row, p in enumerate(params):
        if not p.wants_logprobs:
            out.append(None)
            continue
        top = ()
        if p.logprobs > 0:
            top = tuple(zip(top_ids[row, : p.logprobs].tolist(), top_vals[row, : p.logprobs].tolist()))
        out.append(TokenLogprob(tok[row], chosen[row], top))
    return out
