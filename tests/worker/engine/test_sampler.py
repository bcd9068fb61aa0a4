"""Sampler: greedy, top-k/top-p masks, seeded reproducibility, logprobs."""

import torch

from worker.engine.sampler import Sampler, _apply_top_k_top_p
from worker.engine.sampling_params import SamplingParams

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits(4)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 4, [0] * 4)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 4


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(3)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=1, top_p=0.5)]
    for _ in range(5):
        assert Sampler()(logits, params, [0, 0, 0]).token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(_apply_top_k_top_p(logits, [SamplingParams(top_k=2)])).tolist() == [[False, False, True, True]]
    masked = _apply_top_k_top_p(logits, [SamplingParams(top_p=0.7)])
    assert torch.isinf(masked).tolist() == [[False, False, True, True]]  # 0.5 < 0.7, 0.8 >= 0.7


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    out = Sampler(torch.Generator().manual_seed(1))(logits, [SamplingParams()] * 4000, [0] * 4000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_seeded_rows_do_not_depend_on_batch():
    logits = _logits(8, seed=3)
    params = [SamplingParams(seed=i if i % 2 else None, temperature=0.9 + i / 10, top_k=[0, 10][i % 2], top_p=0.95)
              for i in range(8)]
    idx = [5, 1, 0, 7, 2, 2, 9, 4]
    batched = Sampler()(logits, params, idx).token_ids
    for row in (1, 3, 5, 7):
        alone = Sampler()(logits[row : row + 1], [params[row]], [idx[row]]).token_ids
        assert alone[0] == batched[row]
    # the draw depends on the output index
    draws = {Sampler()(logits[1:2].repeat(1, 1), [params[1]], [i]).token_ids[0] for i in range(30)}
    assert len(draws) > 1


def test_logprobs():
    logits = _logits(2)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0, return_logprobs=True)]
    out = Sampler()(logits, params, [0, 0])
    ref = torch.log_softmax(logits, -1)
    lp0 = out.logprobs[0]
    assert lp0.token_id == out.token_ids[0] and abs(lp0.logprob - ref[0].max().item()) < 1e-5
    assert [t for t, _ in lp0.top] == ref[0].topk(3).indices.tolist()
    assert out.logprobs[1].top == () and abs(out.logprobs[1].logprob - ref[1].max().item()) < 1e-5


def _reference_seeded(logits, params, idx):
    """The full-vocabulary definition of a seeded draw: mask with the full sort, then
    inverse transform sampling with the row's one uniform, in descending-probability
    order when top-k/top-p truncate, in vocabulary order otherwise."""
    from worker.engine.sampler import seed_for_step

    out = []
    for row, (p, i) in enumerate(zip(params, idx)):
        scaled = _apply_top_k_top_p(logits[row : row + 1] / p.temperature, [p])[0]
        order = torch.argsort(scaled, descending=True) if (p.top_p < 1 or p.top_k > 0) else torch.arange(len(scaled))
        probs = torch.softmax(scaled, -1)[order]
        u = torch.tensor((seed_for_step(p.seed, i) >> 40) * 2.0**-24, dtype=torch.float32)  # top 24 bits
        cdf = probs.cumsum(0)
        out.append(int(order[int(torch.searchsorted(cdf, u * cdf[-1]))]))
    return out


def test_candidate_set_matches_full_sort_masks():
    """Top-k/top-p on a narrow candidate set (with the full-sort fallback)
    keeps exactly the tokens the full-vocabulary sort keeps."""
    from worker.engine.sampler import _truncated_candidates

    logits = torch.randn(6, 400, generator=torch.Generator().manual_seed(7)) * 3
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, temperature=2.0), SamplingParams(top_k=50),
              SamplingParams(top_k=20, top_p=0.8), SamplingParams(top_p=0.999, temperature=5.0),
              SamplingParams(top_k=300, top_p=0.95)]
    for width in (8, 64, 400):
        for row, p in enumerate(params):
            scaled = logits[row : row + 1] / p.temperature
            cand, ids, short = _truncated_candidates(scaled, [p], width)
            if bool(short[0]):
                cand, ids, short = _truncated_candidates(scaled, [p], scaled.shape[1])
            assert not bool(short[0])
            kept = set(ids[0][torch.isfinite(cand[0])].tolist())
            ref = set(torch.nonzero(torch.isfinite(_apply_top_k_top_p(scaled, [p])[0])).flatten().tolist())
            assert kept == ref, (width, row)


def test_seeded_draws_match_full_vocabulary_definition():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(11)) * 2
    params = [SamplingParams(seed=s, temperature=[0.7, 1.0, 1.5][s % 3], top_p=[1.0, 0.9, 0.6, 0.95][s % 4],
                             top_k=[0, 0, 5, 0][s % 4]) for s in range(8)]
    for step in range(10):
        idx = [step] * 8
        expected = _reference_seeded(logits, params, idx)
        assert Sampler(candidates=16)(logits, params, idx).token_ids == expected
        assert Sampler(candidates=2)(logits, params, idx).token_ids == expected
        assert Sampler(candidates=(2, 16))(logits, params, idx).token_ids == expected  # three stages
        assert Sampler()(logits, params, idx).token_ids == expected


def test_greedy_rows_unaffected_by_sampled_neighbours():
    logits = _logits(4, seed=5)
    params = [SamplingParams(temperature=0), SamplingParams(top_p=0.9), SamplingParams(temperature=0),
              SamplingParams()]
    out = Sampler()(logits, params, [0] * 4).token_ids
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
