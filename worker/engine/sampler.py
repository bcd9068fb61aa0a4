"""Batched token sampling: the logit controls (worker/engine/logits_processors.py),
greedy, temperature, min-p, top-k, top-p, per-request seeds and logprobs,
vectorized over the rows of one logits tensor."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import inflight_kernels
from worker.engine.logits_processors import apply_logit_controls
from worker.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Top-p candidate-set widths, tried in turn: a row whose candidates hold less
# than top_p is redone with the next width, then with the whole sorted
# vocabulary. topk's cost grows with the width (on a [32, 49152] float32 batch,
# 2 cores: 2.5 ms at 64, 10 ms at 1024, 77 ms for a full sort), and most
# top-p <= 0.95 nuclei of a 49k-vocabulary model at temperature <= 1 fit the
# first or the second.
TOP_P_CANDIDATES = (64, 1024)


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
class TokenBitmask:
    """The tokens a grammar allows on some rows of a logits batch (structured outputs).

    Attributes:
        rows: the constrained rows of the batch (ascending).
        bits: [len(rows), ceil(V / 32)] int32: bit ``j`` of word ``i`` of a row set =
            token ``32 * i + j`` allowed (llguidance's and xgrammar's layout).
    """

    rows: list[int]
    bits: np.ndarray


#: byte -> the 8 additive biases of its bits (bit j set: 0, else -inf), least significant first.
_BIT_BIAS = np.array([[0.0 if (b >> j) & 1 else -np.inf for j in range(8)] for b in range(256)], dtype=np.float32)


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """A copy of ``logits`` [B, V] float32 with the disallowed tokens of ``mask.rows`` set
    to -inf (the other rows as they were). A copy: the runner's logits may be an
    inference-mode tensor, which cannot be written in place.

    On the CPU each constrained row gets an additive bias of 0 / -inf looked up 8 tokens at
    a time from the mask's bytes (SIMD adds, one thread): on [32, 49152] with 16 rows
    masked, 2 busy cores, this was faster than torch's parallel ``masked_fill`` and NumPy's
    boolean assignment (branchy): bench/RESULTS.md, "Measurements first recorded in docstrings".
    """
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        out = logits.detach().numpy().copy()
        bias = _BIT_BIAS[mask.bits.view(np.uint8)].reshape(len(mask.rows), -1)
        for i, row in enumerate(mask.rows):
            out[row] += bias[i, :vocab]
        return torch.from_numpy(out)
    allowed = np.unpackbits(mask.bits.view(np.uint8), axis=1, count=vocab, bitorder="little").view(bool)
    rows = torch.tensor(mask.rows, dtype=torch.int64, device=logits.device)
    keep = torch.from_numpy(allowed).to(logits.device)
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    return out


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

    Non-greedy rows draw one uniform ``u`` each and take the token where the
    cumulative distribution first reaches ``u`` (inverse transform sampling):
    in vocabulary order over the whole vocabulary, or in descending-probability
    order over a top-k/top-p candidate set. One random number per row, not one
    per vocabulary entry: on [32, 49152] float32 rows on 2 cores the exponential
    race it replaced (``argmax(p / E)``, ``E ~ Exp(1)`` per token) took several times
    longer, most of it drawing the noise (bench/RESULTS.md run 19). A seeded row's ``u`` comes from a
    generator seeded by :func:`seed_for_step`, so its draw depends only on
    (seed, index) and its own logits, never on batch neighbours; unseeded rows
    share one batched draw from ``generator`` (or torch's default generator).

    Greedy rows (temperature 0) cost one argmax and nothing else. Rows with
    top-k and/or top-p < 1 work on a candidate set, the ``candidates[0]``
    most likely tokens, then ``candidates[1]``, ... for rows whose set holds
    less than top_p, then the whole vocabulary (see
    :func:`_truncated_candidates` for why the result is the same as masking
    the whole sorted vocabulary); rows with neither use the whole vocabulary.

    On the CPU, when the compiled kernels load (:func:`inflight_kernels.fused_sampler`),
    every sampled row goes through one fused C++ pass instead
    (:func:`inflight_kernels.sample_tokens`: temperature, min-p, top-k, top-p and the same
    inverse-transform draw with the same uniforms, no vocabulary sort; several times
    faster than the torch path, bench/RESULTS.md run 20). The torch code
    below is its definition and the fallback; the two pick the same token except
    where a uniform or top_p lies within float rounding of a cumulative-probability
    boundary.

    Args:
        generator: optional torch.Generator for unseeded rows (tests).
        candidates: width(s) of the top-p candidate sets, tried in turn (>= 1;
            the torch path only).
        use_kernel: None (default): the compiled CPU sampler for CPU float32
            logits when it loads, else torch; False: always torch; True: the
            compiled sampler, and ``__call__`` raises RuntimeError where it
            cannot run (tests, benchmarks).
    """

    def __init__(self, generator: torch.Generator | None = None,
                 candidates: int | tuple[int, ...] = TOP_P_CANDIDATES, use_kernel: bool | None = None) -> None:
        self.generator = generator
        self.candidates = (candidates,) if isinstance(candidates, int) else tuple(candidates)
        self.use_kernel = use_kernel

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
                 prompt_ids: list[list[int]] | None = None, output_ids: list[list[int]] | None = None,
                 eos_token_ids: frozenset[int] = frozenset(),
                 token_bitmask: TokenBitmask | None = None) -> SamplerOutput:
        """Sample a token per row.

        Args:
            logits: [B, vocab] float32 (any device).
            params: B sampling parameters, one per row.
            output_indices: B ints: index in the request's output of the token
                being sampled (0 for the first generated token).
            prompt_ids / output_ids: B token-id lists (each row's prompt and output so
                far), needed when a row has a penalty
                (:func:`worker.engine.logits_processors.apply_logit_controls`).
            eos_token_ids: the tokenizer's EOS ids, masked until a row's ``min_tokens``.
            token_bitmask: the tokens a grammar allows on its rows (structured outputs):
                the others are set to -inf (in a copy of ``logits``) before anything else.

        Returns:
            SamplerOutput with B token ids; logprobs are those of the raw logits
            (before the controls, temperature, top-k and top-p; after a grammar's mask,
            as vLLM's), as vLLM returns them.

        Raises:
            ValueError: if the lengths of logits, params and indices differ, or a row
                has a penalty and the token ids are missing.
            RuntimeError: ``use_kernel=True`` and the compiled sampler cannot take
                these logits (not built, or not CPU float32).
        """
        if not (logits.shape[0] == len(params) == len(output_indices)):
            raise ValueError(f"rows mismatch: logits {tuple(logits.shape)}, {len(params)} params, {len(output_indices)} indices")
        if logits.shape[0] == 0:
            return SamplerOutput([], [])
        raw = logits.float()
        if token_bitmask is not None:
            raw = apply_token_bitmask(raw, token_bitmask)
        logits = apply_logit_controls(raw, params, output_indices, prompt_ids, output_ids, eos_token_ids)
        vocab = logits.shape[1]
        greedy = [r for r, p in enumerate(params) if p.temperature <= 0]
        token_list = [0] * len(params)
        if greedy:
            for row, token in zip(greedy, _argmax(_rows(logits, greedy))):
                token_list[row] = token
        full = [r for r, p in enumerate(params) if p.temperature > 0 and not _truncates(p, vocab)]
        cut = [r for r, p in enumerate(params) if p.temperature > 0 and _truncates(p, vocab)]
        if (full or cut) and (kernel := self._kernel(logits)) is not None:
            for row, token in zip(full + cut, self._sample_kernel(kernel, logits, full, cut, params, output_indices)):
                token_list[row] = token
        else:
            for rows, sample in ((full, self._sample_full), (cut, self._sample_truncated)):
                if rows:
                    picked = sample(logits, rows, [params[r] for r in rows], [output_indices[r] for r in rows])
                    for row, token in zip(rows, picked):
                        token_list[row] = token
        return SamplerOutput(token_list, _logprobs(raw, token_list, params))

    def probabilities(self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int],
                      eos_token_ids: frozenset[int] = frozenset()) -> torch.Tensor:
        """The distribution each row samples from: the logit controls (no penalties:
        callers pass rows without them), temperature, min-p, top-k and top-p applied.

        Args:
            logits: [R, V] float32, every row with temperature > 0.
            params: R sampling parameters.
            output_indices: R ints, the output index of each row's token (for min_tokens).
            eos_token_ids: masked until a row's ``min_tokens``.

        Returns:
            [R, V] float32 probabilities (rows sum to 1; tokens outside a row's
            top-k/top-p/min-p set are 0).

        Raises:
            ValueError: a row is greedy or has a penalty.
        """
        if any(p.temperature <= 0 or p.penalizes for p in params):
            raise ValueError("probabilities() takes rows with temperature > 0 and no penalty")
        controlled = apply_logit_controls(logits.float(), params, output_indices, None, None, eos_token_ids)
        rows = list(range(len(params)))
        scaled = _scaled(controlled, rows, params)
        vocab = scaled.shape[1]
        if not any(_truncates(p, vocab) for p in params):
            return torch.softmax(scaled, dim=-1)
        cand, ids, short = _truncated_candidates(scaled, params, max(self.candidates))
        if bool(short.any()):
            cand, ids, _ = _truncated_candidates(scaled, params, vocab)
        keep = torch.tensor([_truncates(p, vocab) for p in params], device=scaled.device).unsqueeze(1)
        masked = torch.full_like(scaled, float("-inf")).scatter_(1, ids, cand)
        return torch.softmax(torch.where(keep, masked, scaled), dim=-1)

    def uniforms(self, params: list[SamplingParams], draw_indices: list[int],
                 device: torch.device | str = "cpu") -> torch.Tensor:
        """One U[0, 1) per row, [R] float32: a seeded row's depends only on (seed,
        ``draw_indices[row]``) (:func:`seed_for_step`), the others come from this
        sampler's generator."""
        return self._uniforms(params, draw_indices, torch.device(device))

    def _kernel(self, logits: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The compiled CPU sampler (:func:`inflight_kernels.sample_tokens`) when the sampled
        rows of ``logits`` [B, V] go to it (see ``use_kernel``), else None (the torch path);
        raises RuntimeError when ``use_kernel=True`` and it cannot take them."""
        if self.use_kernel is False:
            return None
        kernel = inflight_kernels.fused_sampler(logits)
        if self.use_kernel and kernel is None:
            raise RuntimeError(f"the compiled CPU sampler cannot take {logits.dtype} logits on {logits.device} "
                               f"(kernels available: {inflight_kernels.cpu_kernels_available()})")
        return kernel

    def _sample_kernel(self, kernel: Callable[..., torch.Tensor], logits: torch.Tensor, full: list[int],
                       cut: list[int], params: list[SamplingParams], output_indices: list[int]) -> list[int]:
        """``kernel`` (:func:`inflight_kernels.sample_tokens`) for the rows ``full`` (no top-k/top-p) then
        ``cut`` of ``logits`` [B, V] float32 (CPU): len(full) + len(cut) token ids,
        in that order. The uniforms are drawn as the torch path draws them (the
        ``full`` rows' batch, then the ``cut`` rows'), so a generator gives the
        same tokens on both paths."""
        rows = full + cut
        chosen = [params[r] for r in rows]
        vocab = logits.shape[1]
        uniforms = torch.cat([self._uniforms([params[r] for r in group], [output_indices[r] for r in group],
                                             torch.device("cpu")) for group in (full, cut) if group])
        tokens = kernel(
            logits, torch.tensor(rows, dtype=torch.int64),
            torch.tensor([p.temperature for p in chosen], dtype=torch.float32),
            torch.tensor([p.min_p for p in chosen], dtype=torch.float64),
            torch.tensor([p.top_k if _has_top_k(p, vocab) else 0 for p in chosen], dtype=torch.int64),
            torch.tensor([p.top_p for p in chosen], dtype=torch.float32), uniforms)
        return tokens.tolist()

    def _sample_full(self, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     output_indices: list[int]) -> list[int]:
        """Inverse-transform draw over the whole vocabulary for ``rows`` of ``logits``
        [B, V] float32 (no top-k/top-p); returns len(rows) token ids."""
        probs = torch.softmax(_scaled(logits, rows, params), dim=-1)
        return _inverse_cdf(probs, self._uniforms(params, output_indices, probs.device)).tolist()

    def _sample_truncated(self, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                          output_indices: list[int]) -> list[int]:
        """Top-k/top-p draw for ``rows`` of ``logits`` [B, V] float32 on candidate
        sets of the widths ``self.candidates``, then the whole vocabulary: each stage
        redoes only the rows whose candidates held less than top_p. The scaled logits,
        their row log-sum-exp and each row's uniform are computed once for all stages.
        Returns len(rows) token ids."""
        scaled = _scaled(logits, rows, params)
        needs_lse = not all(_has_top_k(p, scaled.shape[1]) for p in params)
        row_lse = torch.logsumexp(scaled, dim=-1) if needs_lse else None
        uniforms = self._uniforms(params, output_indices, scaled.device)
        tokens = [0] * len(rows)
        pending = list(range(len(rows)))
        for width in (*self.candidates, scaled.shape[1]):
            sub = _rows(scaled, pending)
            sub_lse = None if row_lse is None else _rows(row_lse, pending)
            cand_logits, cand_ids, short = _truncated_candidates(sub, [params[i] for i in pending], width, sub_lse)
            picks = _inverse_cdf(torch.softmax(cand_logits, dim=-1), _rows(uniforms, pending))
            winners = cand_ids.gather(1, picks.unsqueeze(1)).squeeze(1).tolist()
            for i, token in zip(pending, winners):
                tokens[i] = token
            pending = [i for i, redo in zip(pending, short.tolist()) if redo]
            if not pending:
                break
        return tokens

    def _uniforms(self, params: list[SamplingParams], output_indices: list[int],
                  device: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row, [R] float32: unseeded rows from ``self.generator``
        in one batch; a seeded row's is the top 24 bits of :func:`seed_for_step` (a
        splitmix64 output) over 2**24, exact in float32, with no generator built per row
        (its cost: bench/RESULTS.md, "Measurements first recorded in docstrings")."""
        u = torch.rand(len(params), generator=self.generator)
        seeded = [(row, seed_for_step(p.seed, idx) >> 40)
                  for row, (p, idx) in enumerate(zip(params, output_indices)) if p.seed is not None]
        if seeded:
            rows, bits = zip(*seeded)
            u[list(rows)] = torch.tensor(bits, dtype=torch.float32) * 2.0**-24
        return u.to(device)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first column where the cumulative sum of ``probs`` [R, W] reaches
    ``uniforms`` [R] times the row's total: [R] int64 column indices (zero-probability
    columns are never chosen)."""
    cdf = probs.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _truncates(p: SamplingParams, vocab: int) -> bool:
    """True when top-k or top-p removes tokens from the row's distribution."""
    return _has_top_k(p, vocab) or p.top_p < 1.0


def _has_top_k(p: SamplingParams, vocab: int) -> bool:
    """True when the row's top-k keeps fewer than ``vocab`` tokens."""
    return 0 < p.top_k < vocab


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]`` (rows along dim 0, e.g. [R, V]): the tensor itself
    when ``rows`` is every row in order (the common case; no copy)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(rows, device=logits.device)]


def _argmax(logits: torch.Tensor) -> list[int]:
    """Row-wise argmax of [R, V] float32 logits (the first maximum, as torch's). On the
    CPU through NumPy: torch's CPU argmax along the last dimension was many times slower
    on a [32, 49152] batch on a 2-core EPYC (bench/RESULTS.md run 19)."""
    if logits.device.type == "cpu":
        return logits.contiguous().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _scaled(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """``logits[rows] / temperature`` [R, V] float32 (every temperature > 0), with the
    tokens below each row's ``min_p`` times its top probability set to -inf: in log
    space, below the row's maximum plus ``log(min_p)``."""
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    scaled = _rows(logits, rows) / temps.unsqueeze(1)
    if not any(p.min_p > 0 for p in params):
        return scaled
    floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params],
                         dtype=torch.float32, device=logits.device)
    cut = scaled.amax(dim=-1) + floor
    return scaled.masked_fill(scaled < cut.unsqueeze(1), float("-inf"))


def _truncated_candidates(scaled: torch.Tensor, params: list[SamplingParams], candidates: int,
                          row_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p (Holtzman et al. ICLR'20) on the ``W`` most likely
    tokens of each row instead of a full-vocabulary sort.

    Args:
        scaled: [R, V] float32 temperature-scaled logits.
        params: R parameters, each with top-k and/or top-p < 1.
        candidates: candidate-set width for rows without a top-k.
        row_lse: [R] float32 ``logsumexp(scaled, dim=-1)`` when the caller
            has it (computed here otherwise, if some row has no top-k).

    Returns:
        (logits, ids, short): [R, W] float32 candidate logits, most likely
        first, with tokens outside top-k/top-p set to -inf; [R, W] int64
        their vocabulary ids; [R] bool, True for rows whose candidates hold
        less than top_p (their masks are not valid: redo them with
        ``candidates=V``). ``W = min(V, max(candidates, max top_k))``.

    Exactness: the nucleus is the shortest sorted prefix whose mass reaches
    top_p, mass taken over the top-k survivors (all tokens when top_k is
    off). A row with a top-k has all its survivors among the W candidates,
    so its masks are computed exactly as on the sorted vocabulary. A row
    without one normalizes by the log-sum-exp of its whole row; if the W
    candidates hold mass >= top_p, every token of rank >= W has
    ``mass_before >= top_p`` and is masked by the full-sort rule too, so
    the candidate set contains the whole nucleus. Rows whose candidates hold
    less are flagged in ``short`` (never when W = V). Differences
    from the full sort are floating-point rounding of the sums only.
    """
    vocab = scaled.shape[1]
    top_k = [p.top_k if _has_top_k(p, vocab) else 0 for p in params]
    width = min(vocab, max(candidates, max(top_k)))
    cand, ids = scaled.topk(width, dim=-1)
    ranks = torch.arange(width, device=scaled.device).unsqueeze(0)
    k = torch.tensor([kk or vocab for kk in top_k], device=scaled.device).unsqueeze(1)
    cand = cand.masked_fill(ranks >= k, float("-inf"))
    has_k = torch.tensor([kk > 0 for kk in top_k], device=scaled.device)
    if all(top_k):
        norm = torch.logsumexp(cand, dim=-1).unsqueeze(1)
    else:
        if row_lse is None:
            row_lse = torch.logsumexp(scaled, dim=-1)
        norm = torch.where(has_k, torch.logsumexp(cand, dim=-1), row_lse).unsqueeze(1)
    probs = torch.exp(cand - norm)
    cumulative = probs.cumsum(dim=-1)
    p = torch.tensor([pp.top_p for pp in params], dtype=torch.float32, device=scaled.device).unsqueeze(1)
    short = (cumulative[:, -1] < p.squeeze(1)) & ~has_k & (width < vocab)
    cand = cand.masked_fill((cumulative - probs >= p) & (ranks > 0), float("-inf"))
    return cand, ids, short


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


def _logprobs(logits: torch.Tensor, token_list: list[int], params: list[SamplingParams]) -> list[TokenLogprob | None]:
    if not any(p.wants_logprobs for p in params):
        return [None] * len(params)
    tokens = torch.tensor(token_list, device=logits.device)
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
        if p.logprobs > 0:  # a grammar's forbidden tokens (-inf) are no alternatives
            top = tuple((t, v) for t, v in zip(top_ids[row, : p.logprobs].tolist(),
                                               top_vals[row, : p.logprobs].tolist()) if v != float("-inf"))
        out.append(TokenLogprob(tok[row], chosen[row], top))
    return out
