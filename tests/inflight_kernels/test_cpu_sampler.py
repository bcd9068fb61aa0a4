"""The compiled CPU sampler (inflight_kernels/cpu/sampler.cpp, ``inflight_kernels.sample_tokens``)
against a float64 definition of the sampling rule and against the Sampler's torch
path, token for token, plus its edge cases, argument checks and thread count.

The definition (:func:`tests.inflight_kernels.sampler_reference.reference_token`) flags rows
whose uniform or top_p lies within 1e-5 of a cumulative-probability boundary, or
whose order depends on equal scaled logits; on every other row the kernel, the torch
path and the definition must pick the same token, and most rows must be compared.
These tests fail, rather than skip, when the extension does not build (as
tests/inflight_kernels/test_cpu_kernels.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import inflight_kernels
from inflight_kernels.cpu import ops as cpu_ops
from tests.inflight_kernels.sampler_reference import reference_token
from worker.engine.sampler import Sampler
from worker.engine.sampling_params import SamplingParams

INF = float("inf")


def _logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of several shapes: Gaussian of several widths, a few spiked tokens,
    10% -inf entries (as min_tokens masks EOS), only three finite entries."""
    out = torch.randn(rows, vocab, generator=gen)
    for r in range(rows):
        kind = r % 6
        if kind in (0, 1, 2):
            out[r] *= (0.5, 4.0, 10.0)[kind]
        elif kind == 3:
            out[r] *= 2
            out[r, torch.randint(vocab, (5,), generator=gen)] += 12
        elif kind == 4:
            out[r] *= 3
            out[r, torch.rand(vocab, generator=gen) < 0.1] = -INF
        elif vocab > 3:
            finite = torch.randperm(vocab, generator=gen)[:3]
            row = torch.full((vocab,), -INF)
            row[finite] = out[r, finite]
            out[r] = row
    return out


def _params(rows: int, vocab: int, rng: np.random.Generator) -> list[SamplingParams]:
    """Random combinations of temperature, top-p, top-k (off, 0/-1/V included) and min-p."""
    temps = (0.25, 0.8, 1.0, 2.5)
    top_ps = (1.0, 1.0, 0.95, 0.9, 0.5, 0.1)
    top_ks = (0, 0, 0, 1, 3, 50, 700, vocab, -1)
    min_ps = (0.0, 0.0, 0.02, 0.2)
    return [SamplingParams(temperature=float(rng.choice(temps)), top_p=float(rng.choice(top_ps)),
                           top_k=int(rng.choice(top_ks)), min_p=float(rng.choice(min_ps))) for _ in range(rows)]


def _kernel(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor,
            rows: list[int] | None = None) -> list[int]:
    rows = list(range(logits.shape[0])) if rows is None else rows
    return inflight_kernels.sample_tokens(
        logits, torch.tensor(rows), torch.tensor([p.temperature for p in params]),
        torch.tensor([p.min_p for p in params], dtype=torch.float64), torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]), uniforms).tolist()


def _torch_token(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """The Sampler's torch path on one row [1, V] with its uniform forced to ``u``."""
    sampler = Sampler(use_kernel=False)
    sampler._uniforms = lambda params, idx, device: torch.tensor([u], dtype=torch.float32, device=device)
    return sampler(logits, [p], [0]).token_ids[0]


def test_kernels_build():
    assert cpu_ops.available(), "the CPU kernels did not build or load (see the log)"
    assert inflight_kernels.sampler_backend(torch.zeros(1, 4)) == "cpu"
    assert inflight_kernels.sampler_backend(torch.zeros(1, 4, dtype=torch.float64)) == "reference"
    assert inflight_kernels.fused_sampler(torch.zeros(1, 4)) is inflight_kernels.sample_tokens
    assert inflight_kernels.fused_sampler(torch.zeros(1, 4, dtype=torch.float64)) is None


@pytest.mark.parametrize("vocab,rows", [(7, 300), (100, 400), (1000, 400), (4099, 300), (49152, 120)])
def test_same_tokens_as_float64_definition_and_torch_path(vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = _logits(rows, vocab, gen)
    params = _params(rows, vocab, np.random.default_rng(vocab))
    uniforms = torch.rand(rows, generator=gen)
    got = _kernel(logits, params, uniforms)
    compared = 0
    for r in range(rows):
        want, ambiguous = reference_token(logits[r].numpy(), params[r], float(uniforms[r]))
        if ambiguous:
            continue
        compared += 1
        detail = (r, params[r], float(uniforms[r]))
        assert got[r] == want, detail
        assert _torch_token(logits[r : r + 1], params[r], float(uniforms[r])) == want, detail
    assert compared >= 0.85 * rows, f"only {compared} of {rows} rows were unambiguous"


def _wide_rows(rows: int, vocab: int, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """Scaled logits (times ``temperature``) whose nuclei hold thousands of tokens, each
    with enough mass (>= 1e-4) that few uniforms fall within 1e-5 of a boundary:
    even rows, a flat head of 6000 distinct logits within about one nat over a Gaussian
    tail 12 nats below (more candidates than the exp pass collects: the threshold
    search, narrowed by bisection); odd rows, one token 8.5 nats above 2000 distinct
    ones, the rest -inf (no gap of the exp pass holds top_p: the gap doubles)."""
    out = torch.full((rows, vocab), -INF)
    for r in range(rows):
        ids = torch.randperm(vocab, generator=gen)
        if r % 2 == 0:
            out[r] = torch.randn(vocab, generator=gen)
            span = 0.6 + 0.8 * float(torch.rand(1, generator=gen))
            out[r, ids[:6000]] = 12 + torch.randperm(6000, generator=gen).float() * (span / 6000)
        else:
            out[r, ids[:2000]] = torch.randperm(2000, generator=gen).float() / 4000
            out[r, ids[2000]] = 8.5
    return out * temperature


@pytest.mark.parametrize("top_p,top_k,min_p", [(0.9, 0, 0.0), (0.97, 0, 0.0), (0.5, 0, 0.2), (0.9, 2500, 0.0),
                                               (1.0, 3000, 0.0), (1.0, 0, 0.6)])
@pytest.mark.parametrize("temperature", [0.7, 3.0])
def test_wide_nuclei(top_p, top_k, min_p, temperature):
    """Nuclei and top-k sets of thousands of tokens in a 49k vocabulary (the kernel's
    threshold search beyond its first candidate set) against the definition."""
    gen = torch.Generator().manual_seed(int(top_p * 1000) + top_k)
    logits = _wide_rows(24, 49152, temperature, gen)
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)] * 24
    uniforms = torch.rand(24, generator=gen)
    got = _kernel(logits, params, uniforms)
    compared = 0
    for r in range(24):
        want, ambiguous = reference_token(logits[r].numpy(), params[r], float(uniforms[r]))
        if not ambiguous:
            compared += 1
            assert got[r] == want, (r, float(uniforms[r]))
    assert compared >= 12, f"only {compared} of 24 rows were unambiguous"


def test_edge_uniforms_and_degenerate_rows():
    below_one = float(np.nextafter(np.float32(1), np.float32(0)))
    flat = torch.zeros(1, 64)
    distinct = torch.linspace(0, 1, 64).unsqueeze(0)
    plain = SamplingParams(temperature=1.0)
    top3 = SamplingParams(temperature=1.0, top_k=3)
    # u = 0: the first live token in vocabulary order, or the most likely one when truncated.
    masked = flat.clone()
    masked[0, :5] = -INF
    assert _kernel(masked, [plain], torch.tensor([0.0])) == [5]
    assert _kernel(distinct, [top3], torch.tensor([0.0])) == [63]
    # u just below 1: the last live token / the last one kept.
    assert _kernel(flat, [plain], torch.tensor([below_one])) == [63]
    assert _kernel(distinct, [top3], torch.tensor([below_one])) == [61]
    # top_k=1, min_p=1 and a tiny top_p are the argmax; -inf and NaN tokens are never drawn.
    row = torch.randn(1, 500, generator=torch.Generator().manual_seed(3))
    row[0, 7] = float("nan")
    argmax = int(torch.nan_to_num(row, nan=-INF).argmax())
    for p in (SamplingParams(top_k=1), SamplingParams(min_p=1.0), SamplingParams(top_p=1e-6)):
        assert _kernel(row, [p] * 3, torch.tensor([0.0, 0.5, below_one]), [0, 0, 0]) == [argmax] * 3
    picks = _kernel(row.repeat(200, 1), [plain] * 200, torch.rand(200, generator=torch.Generator().manual_seed(4)))
    assert 7 not in picks
    lonely = torch.full((1, 300), -INF)
    lonely[0, 123] = -50.0
    assert _kernel(lonely, [plain, top3, SamplingParams(top_p=0.5)], torch.tensor([0.3, 0.6, 0.9]), [0, 0, 0]) == [123] * 3
    assert _kernel(torch.full((1, 10), -INF), [plain], torch.tensor([0.5])) == [0]  # nothing finite: token 0


def test_rows_pick_from_the_listed_rows():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 2000, generator=gen) * 5
    p = SamplingParams(temperature=0.9, top_p=0.9)
    u = torch.rand(5, generator=gen)
    rows = [2, 0, 2, 3, 1]
    together = _kernel(logits, [p] * 5, u, rows)
    alone = [_kernel(logits[r : r + 1], [p], u[i : i + 1])[0] for i, r in enumerate(rows)]
    assert together == alone
    strided = torch.randn(4, 4000, generator=gen)[:, ::2]  # non-contiguous rows are copied, not misread
    assert _kernel(strided, [p] * 4, u[:4]) == _kernel(strided.contiguous(), [p] * 4, u[:4])


def test_one_and_two_threads_agree():
    gen = torch.Generator().manual_seed(10)
    logits = _logits(64, 3000, gen)
    params = _params(64, 3000, np.random.default_rng(10))
    u = torch.rand(64, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernel(logits, params, u)
        torch.set_num_threads(2)
        two = _kernel(logits, params, u)
    finally:
        torch.set_num_threads(threads)
    assert one == two


def test_follows_the_distribution():
    """Frequencies over many uniforms: the whole distribution, and top-p's renormalized nucleus."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).unsqueeze(0)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(5))
    for p, expected in ((SamplingParams(), probs), (SamplingParams(top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]))):
        picks = torch.tensor(_kernel(logits, [p] * 20000, u, [0] * 20000))
        freq = torch.bincount(picks, minlength=4).float() / 20000
        assert torch.allclose(freq, expected, atol=0.015), (p, freq)


@pytest.mark.parametrize("change", ["row", "temperature", "min_p", "length", "dims"])
def test_bad_arguments_raise(change):
    logits = torch.randn(2, 50)
    args = dict(rows=torch.tensor([0, 1]), temperature=torch.tensor([1.0, 1.0]), min_p=torch.tensor([0.0, 0.0]),
                top_k=torch.tensor([0, 0]), top_p=torch.tensor([1.0, 1.0]), uniforms=torch.tensor([0.1, 0.2]))
    if change == "row":
        args["rows"] = torch.tensor([0, 2])
    elif change == "temperature":
        args["temperature"] = torch.tensor([1.0, 0.0])
    elif change == "min_p":
        args["min_p"] = torch.tensor([0.0, 1.5])
    elif change == "length":
        args["uniforms"] = torch.tensor([0.1])
    else:
        logits = torch.randn(100)
    with pytest.raises(RuntimeError):
        inflight_kernels.sample_tokens(logits, **args)
