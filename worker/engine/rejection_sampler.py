"""Which draft tokens a verification pass accepts (speculative decoding).

A sequence with ``k`` draft tokens ``d_0..d_{k-1}`` is run through the model as one
chunk ``[last token, d_0, .., d_{k-1}]``; its ``k + 1`` logits rows give the target
distribution ``p_i`` after each prefix. The emitted tokens are the accepted drafts
and one more token, so every verification step makes at least one token.

- Greedy rows accept ``d_i`` while it equals the argmax of ``p_i``; the argmax at
  the first mismatch (or after the last draft) follows. The output is exactly what
  decoding without drafts gives.
- Sampled rows use speculative sampling's rejection rule (Leviathan et al. ICML'23;
  Chen et al. 2023): accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``;
  at the first rejection, sample from the residual ``max(0, p_i - q_i)``
  renormalised; after ``k`` acceptances, sample the bonus token from ``p_k``. The
  n-gram proposer is deterministic, so ``q_i`` is a point mass at ``d_i``: the
  acceptance probability is ``p_i(d_i)`` and the residual is ``p_i`` with ``d_i``
  removed. Each emitted token is distributed exactly as ``p`` says, so the output
  distribution is that of decoding without drafts.
"""

from __future__ import annotations

import torch


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """Emitted tokens of a greedy row.

    Args:
        targets: ``k + 1`` argmax tokens, one per verification row.
        drafts: the ``k`` draft tokens.

    Returns:
        The leading drafts equal to their target, then the target at the first
        mismatch (or the last target): 1 to ``k + 1`` tokens.
    """
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


def accept_sampled(probs: torch.Tensor, drafts: list[int], accept_uniforms: torch.Tensor,
                   resample_uniform: float, bonus: int) -> list[int]:
    """Emitted tokens of a sampled row (rejection sampling against a point-mass draft).

    Args:
        probs: [k + 1, V] float32, the target distribution after each prefix.
        drafts: the ``k`` draft tokens.
        accept_uniforms: [k] U[0, 1) draws, one per draft.
        resample_uniform: a U[0, 1) draw for the residual sample at a rejection.
        bonus: a token already sampled from ``probs[k]`` (used when all k are accepted).

    Returns:
        1 to ``k + 1`` tokens: the accepted drafts, then a residual sample or ``bonus``.
    """
    k = len(drafts)
    if k == 0:
        return [bonus]
    index = torch.arange(k, device=probs.device)
    draft_ids = torch.tensor(drafts, device=probs.device)
    p_draft = probs[index, draft_ids].cpu()
    rejected = (accept_uniforms.cpu() >= p_draft).nonzero()
    if len(rejected) == 0:
        return drafts + [bonus]
    first = int(rejected[0, 0])
    residual = probs[first].clone()
    residual[drafts[first]] = 0.0
    return drafts[:first] + [_inverse_cdf_one(residual, resample_uniform)]


def _inverse_cdf_one(weights: torch.Tensor, u: float) -> int:
    """The first index where the cumulative sum of ``weights`` [V] (>= 0, not all 0)
    exceeds ``u`` (in [0, 1)) times its total: a zero-weight entry is never chosen."""
    cdf = weights.double().cumsum(0)
    target = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    return min(int(torch.searchsorted(cdf, target, right=True)[0]), weights.shape[0] - 1)
