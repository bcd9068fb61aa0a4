"""A float64 definition of the sampler's rule for one row, with flags for where float
rounding may legitimately change the token (shared by the CPU-sampler tests in
tests/inflight_kernels and tests/worker/engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from worker.engine.sampling_params import SamplingParams

#: A row is ambiguous when its uniform or its top_p lies within this of a boundary
#: of the (normalized) cumulative probabilities.
MARGIN = 1e-5


@dataclass
class Draw:
    """One row's kept tokens in draw order, their normalized cumulative
    probabilities, their scaled logits, and whether the kept set itself is in
    doubt (top_p within :data:`MARGIN` of a boundary, or a tie across the top-k or
    top-p cut). ``ordered``: False for vocabulary order (no top-k/top-p)."""

    tokens: np.ndarray
    cdf: np.ndarray
    scaled: np.ndarray
    set_ambiguous: bool
    ordered: bool

    def token(self, u: float) -> tuple[int, bool]:
        """(token, ambiguous) for uniform ``u``: the first kept token whose
        cumulative probability reaches ``u``; ambiguous when ``u`` is within
        :data:`MARGIN` of a boundary, when the kept set is in doubt, or when
        the drawn token's scaled logit equals another kept token's (their order
        is arbitrary)."""
        pos = min(int(np.searchsorted(self.cdf, u)), len(self.tokens) - 1)
        near = bool(np.abs(np.concatenate([[0.0], self.cdf]) - u).min() < MARGIN)
        tie = self.ordered and int((self.scaled == self.scaled[pos]).sum()) > 1
        return int(self.tokens[pos]), near or tie or self.set_ambiguous


def reference_draw(x: np.ndarray, p: SamplingParams) -> Draw:
    """The kept tokens of float32 logits ``x`` [V] under ``p``, as
    worker/engine/sampler.py defines them: ``s = x / temperature`` rounded to
    float32 (as torch divides); min-p drops ``s < max(s) + float32(log(min_p))``
    (float32, as torch); without top-k/top-p every live token in vocabulary
    order; with them the descending order of ``s``, the first top_k, then the
    top-p prefix (a token stays while the mass before it, normalized over the
    top-k survivors or over the whole row, is < top_p; the first always stays).
    Probabilities in float64."""
    vocab = x.shape[0]
    s = (x / np.float32(p.temperature)).astype(np.float32)
    m = s.max()
    keep = np.isfinite(s)
    if p.min_p > 0:
        keep &= s >= np.float32(m + np.float32(math.log(p.min_p)))
    e = np.where(keep, np.exp(np.where(keep, s, 0).astype(np.float64) - float(m)), 0.0)
    has_k = 0 < p.top_k < vocab
    if not has_k and p.top_p >= 1:
        live = np.flatnonzero(e > 0)
        cdf = np.cumsum(e[live]) / e.sum()
        return Draw(live, cdf, s[live], False, False)
    order = np.flatnonzero(keep)
    order = order[np.argsort(-s[order], kind="stable")]
    doubt = False
    if has_k:
        doubt = bool(len(order) > p.top_k and s[order[p.top_k - 1]] == s[order[p.top_k]])
        order = order[: p.top_k]
    mass = e[order] / (e[order].sum() if has_k else e.sum())
    kept = len(order)
    if p.top_p < 1:
        top_p = float(np.float32(p.top_p))
        before = np.cumsum(mass) - mass
        outside = np.flatnonzero(before[1:] >= top_p)
        kept = int(outside[0]) + 1 if len(outside) else len(order)
        doubt |= bool(len(before) > 1 and np.abs(before[1:] - top_p).min() < MARGIN)
    if kept < len(order) and s[order[kept - 1]] == s[order[kept]]:
        doubt = True
    cdf = np.cumsum(mass[:kept]) / mass[:kept].sum()
    return Draw(order[:kept], cdf, s[order[:kept]], doubt, True)


def reference_token(x: np.ndarray, p: SamplingParams, u: float) -> tuple[int, bool]:
    """(token, ambiguous) for float32 logits ``x`` [V] under ``p`` with uniform
    ``u`` (:func:`reference_draw`, :meth:`Draw.token`)."""
    return reference_draw(x, p).token(u)
