"""The sampler's logit controls against their definitions: transformers' repetition
penalty and min-p warpers as oracles, OpenAI's presence/frequency formula, logit_bias
and min_tokens through the engine; rows without a control are left bit for bit."""

from __future__ import annotations

import pytest
import torch

from worker.engine.logits_processors import apply_logit_controls
from worker.engine.sampler import Sampler
from worker.engine.sampling_params import SamplingParams
from tests.worker.engine_helpers import drain, make_engine, request

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_no_control_returns_the_same_tensor():
    logits = _logits(3)
    assert apply_logit_controls(logits, [SamplingParams()] * 3, [0, 1, 2]) is logits


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = _logits(2)
    prompt, output = [[1, 2, 3], [4, 4]], [[3, 7], [9]]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7)]
    got = apply_logit_controls(logits, params, [2, 1], prompt, output)
    for row, penalty in enumerate((1.3, 0.7)):
        seen = torch.tensor([prompt[row] + output[row]])
        want = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits[row: row + 1].clone())
        torch.testing.assert_close(got[row], want[0])


def test_presence_and_frequency_follow_openai():
    logits = _logits(1)
    output = [[5, 5, 5, 8]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=1.25)]
    got = apply_logit_controls(logits, params, [4], [[1]], output)
    want = logits.clone()
    want[0, 5] -= 0.5 + 3 * 1.25
    want[0, 8] -= 0.5 + 1 * 1.25
    torch.testing.assert_close(got, want)
    assert not torch.equal(got[0, 1], logits[0, 1] - 0.5)  # the prompt does not count for OpenAI's penalties


def test_rows_without_controls_are_untouched_in_a_mixed_batch():
    logits = _logits(4)
    params = [SamplingParams(), SamplingParams(frequency_penalty=2.0), SamplingParams(logit_bias={3: 5.0}),
              SamplingParams(min_tokens=4, stop_token_ids=(6,))]
    got = apply_logit_controls(logits, params, [0, 0, 0, 0], [[1]] * 4, [[2], [2], [2], [2]], frozenset({0}))
    assert torch.equal(got[0], logits[0])
    assert got[1, 2] == logits[1, 2] - 2.0 and got[2, 3] == logits[2, 3] + 5.0
    assert got[3, 0] == float("-inf") and got[3, 6] == float("-inf")


def test_penalties_need_the_history():
    with pytest.raises(ValueError, match="token ids"):
        apply_logit_controls(_logits(1), [SamplingParams(presence_penalty=1.0)], [0])


def test_min_p_matches_transformers_warper():
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = _logits(1) / 3
    keep = MinPLogitsWarper(0.2)(None, logits.clone())[0] > float("-inf")
    assert 1 < int(keep.sum()) < V
    params = [SamplingParams(temperature=1.0, min_p=0.2, seed=s) for s in range(200)]
    tokens = Sampler()(logits.expand(200, V).contiguous(), params, [0] * 200).token_ids
    assert all(keep[t] for t in tokens)
    assert len(set(tokens)) > 1  # it still samples, among the kept ones


def test_logit_bias_steers_greedy_and_bans():
    logits = _logits(1)
    top = int(logits.argmax())
    banned = Sampler()(logits, [SamplingParams(temperature=0, logit_bias={top: -100})], [0]).token_ids[0]
    assert banned != top
    forced = Sampler()(logits, [SamplingParams(temperature=0, logit_bias={11: 100})], [0]).token_ids[0]
    assert forced == 11


def test_logprobs_are_of_the_raw_distribution():
    logits = _logits(1)
    out = Sampler()(logits, [SamplingParams(temperature=0, logit_bias={11: 100}, return_logprobs=True)], [0])
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 11].item())


def test_min_tokens_holds_eos_back_in_the_engine():
    eng = make_engine()
    eos = sorted(eng.tokenizer.eos_token_ids)[0]
    bias = {eos: 100.0}  # EOS would win every step
    results = {}
    eng.add_request(request("a", max_tokens=6, min_tokens=4, logit_bias=bias))
    eng.add_request(request("b", max_tokens=6, logit_bias=bias))
    drain(eng, results)
    assert results["a"].completion_tokens == 5 and results["a"].finish_reason == "stop"
    assert results["b"].completion_tokens == 1 and results["b"].finish_reason == "stop"


def test_repetition_penalty_in_the_engine_acts_on_its_row_only():
    def run(*with_penalty: bool) -> dict:
        eng, results = make_engine(), {}
        for i, pen in enumerate(with_penalty):
            eng.add_request(request(f"r{i}", max_tokens=8, logit_bias={7: 100.0},
                                    repetition_penalty=60.0 if pen else 1.0))
        drain(eng, results)
        return results

    alone, mixed = run(False), run(False, True)
    assert alone["r0"].token_ids == mixed["r0"].token_ids == [7] * 8  # the bias wins every step
    penalized = mixed["r1"].token_ids
    assert penalized[0] == 7 and penalized.count(7) < 8  # once seen, 7's logit is divided by 60
