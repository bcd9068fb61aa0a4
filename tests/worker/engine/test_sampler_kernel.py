"""The Sampler's two paths: the compiled CPU sampler (``inflight_kernels.sample_tokens``), taken
by default for CPU float32 logits, and the torch path (its definition and fallback).

Every test of test_sampler.py runs again on the torch path (the default now takes the
kernel); a mixed batch (greedy, seeded, unseeded, top-k/top-p/min-p, logit controls,
logprobs) gives the same tokens on both paths wherever the float64 definition says
rounding cannot decide; ``use_kernel`` picks or forbids the kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import inflight_kernels
from tests.inflight_kernels.sampler_reference import reference_token
from tests.worker.engine import test_sampler
from worker.engine import sampler as sampler_module
from worker.engine.logits_processors import apply_logit_controls
from worker.engine.sampler import Sampler
from worker.engine.sampling_params import SamplingParams

SAMPLER_TESTS = sorted(name for name in dir(test_sampler) if name.startswith("test_"))


@pytest.mark.parametrize("name", SAMPLER_TESTS)
def test_sampler_tests_on_the_torch_path(name, monkeypatch):
    monkeypatch.setattr(sampler_module.inflight_kernels, "fused_sampler", lambda logits: None)
    monkeypatch.setattr(sampler_module.inflight_kernels, "sample_tokens", _forbidden)
    getattr(test_sampler, name)()


def _forbidden(*args, **kwargs):
    raise AssertionError("the torch path called the compiled sampler")


def test_default_takes_the_kernel_on_cpu_float32(monkeypatch):
    calls = []
    real, fused_sampler = inflight_kernels.sample_tokens, inflight_kernels.fused_sampler

    def spy(*args):
        calls.append(args[1].tolist())
        return real(*args)

    # the sampler calls what fused_sampler hands out: the spy wherever the real one would be
    monkeypatch.setattr(sampler_module.inflight_kernels, "fused_sampler",
                        lambda logits: None if fused_sampler(logits) is None else spy)
    logits = torch.randn(4, 100)
    params = [SamplingParams(top_p=0.9), SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=5)]
    Sampler()(logits, params, [0] * 4)
    assert calls == [[2, 0, 3]]  # one call: the full row, then the truncated ones; greedy rows stay NumPy's
    Sampler(use_kernel=False)(logits, params, [0] * 4)
    assert len(calls) == 1
    Sampler()(logits.double(), params, [0] * 4)  # the sampler works on float32 copies of other dtypes
    assert len(calls) == 2


def test_use_kernel_true_raises_where_it_cannot_run(monkeypatch):
    monkeypatch.setattr(sampler_module.inflight_kernels, "fused_sampler", lambda logits: None)
    logits, params = torch.randn(2, 50), [SamplingParams()] * 2
    with pytest.raises(RuntimeError):
        Sampler(use_kernel=True)(logits, params, [0, 0])
    assert len(Sampler()(logits, params, [0, 0]).token_ids) == 2  # the default falls back to torch


def _mixed_batch(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    logits = torch.randn(rows, vocab, generator=gen) * torch.tensor(rng.choice([1.0, 3.0, 6.0], rows),
                                                                    dtype=torch.float32).unsqueeze(1)
    params = []
    for r in range(rows):
        extra = {}
        if r % 5 == 1:
            extra = dict(logit_bias={3: 5.0, 7: -100.0}, min_tokens=2)
        elif r % 5 == 2:
            extra = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
        params.append(SamplingParams(
            temperature=float(rng.choice([0.0, 0.5, 0.8, 1.3])), top_p=float(rng.choice([1.0, 0.95, 0.8, 0.3])),
            top_k=int(rng.choice([0, 0, 1, 10, 200])), min_p=float(rng.choice([0.0, 0.0, 0.05])),
            seed=int(rng.integers(1000)) if r % 3 == 0 else None, logprobs=int(r % 4 == 0) * 2, **extra))
    return logits, params


@pytest.mark.parametrize("vocab", [500, 49152])
def test_kernel_and_torch_paths_pick_the_same_tokens(vocab):
    rows = 96 if vocab == 500 else 32
    logits, params = _mixed_batch(rows, vocab, seed=vocab)
    idx = [r % 4 for r in range(rows)]
    history = [[(r * 7 + j) % vocab for j in range(12)] for r in range(rows)]
    out_ids = [[(r * 11 + j) % vocab for j in range(5)] for r in range(rows)]
    eos = frozenset({0})
    results = {}
    for use_kernel in (True, False):
        sampler = Sampler(torch.Generator().manual_seed(42), use_kernel=use_kernel)
        drawn = []
        original = sampler._uniforms

        def recorded(p, i, device, original=original, drawn=drawn):
            u = original(p, i, device)
            drawn.append(u)
            return u

        sampler._uniforms = recorded
        results[use_kernel] = (sampler(logits, params, idx, history, out_ids, eos), drawn)
    (fast, fast_u), (slow, slow_u) = results[True], results[False]
    assert all(torch.equal(a, b) for a, b in zip(fast_u, slow_u))  # same uniforms, drawn in the same order
    # The uniform of each sampled row: the full rows' batch, then the truncated rows'.
    controlled = apply_logit_controls(logits, params, idx, history, out_ids, eos)
    full = [r for r, p in enumerate(params) if p.temperature > 0 and not sampler_module._truncates(p, vocab)]
    cut = [r for r, p in enumerate(params) if p.temperature > 0 and sampler_module._truncates(p, vocab)]
    uniform = dict(zip(full + cut, torch.cat(fast_u).tolist()))
    compared = 0
    for r, p in enumerate(params):
        if p.temperature == 0:
            assert fast.token_ids[r] == slow.token_ids[r] == int(controlled[r].argmax())
            continue
        want, ambiguous = reference_token(controlled[r].numpy(), p, uniform[r])
        if ambiguous:
            continue
        compared += 1
        assert fast.token_ids[r] == slow.token_ids[r] == want, (r, p)
    assert compared >= 0.6 * len(uniform)
    same = [r for r in range(rows) if fast.token_ids[r] == slow.token_ids[r]]
    assert [fast.logprobs[r] for r in same] == [slow.logprobs[r] for r in same]


def test_seeded_rows_do_not_depend_on_batch_on_the_kernel_path():
    logits = torch.randn(8, 49152, generator=torch.Generator().manual_seed(3)) * 4
    params = [SamplingParams(seed=i, temperature=0.8, top_p=[1.0, 0.9][i % 2], top_k=[0, 0, 40, 0][i % 4])
              for i in range(8)]
    idx = list(range(8))
    batched = Sampler(use_kernel=True)(logits, params, idx).token_ids
    for row in range(8):
        assert Sampler(use_kernel=True)(logits[row : row + 1], [params[row]], [idx[row]]).token_ids[0] == batched[row]


def test_sampler_bench_compares_both_paths(tmp_path):
    import csv

    from bench import sampler as bench_sampler

    args = ["--batches", "2", "--repeats", "1", "--history", "8", "--compare", "--out", str(tmp_path)]
    assert bench_sampler.main(args) == 0
    with next(tmp_path.glob("*-sampler.csv")).open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["case"], r["path"]) for r in rows] == [(c, p) for c in bench_sampler.CASES for p in ("kernel", "torch")]
