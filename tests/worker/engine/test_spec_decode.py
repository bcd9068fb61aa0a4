"""Speculative decoding with n-gram drafts: the proposer, the acceptance rules, and
the engine with it on (greedy output unchanged, blocks given back, limits kept)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.engine_helpers import assert_no_leaks, drain
from tests.worker.fakes import FakeRunner, ManualClock, fake_tokenizer
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.engine_config import EngineConfig, SpeculativeConfig
from worker.engine.ngram_proposer import propose_ngram
from worker.engine.rejection_sampler import accept_greedy, accept_sampled
from worker.engine.sampling_params import SamplingParams

PROMPTS = ["hello world hello world hello", "the cat sat on the mat the cat", "a b c a b c a b",
           "continuous batching", "日本語 日本語 日本", "paged attention paged"]


def test_propose_ngram_takes_the_longest_most_recent_match():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3) == [4, 5, 1]
    assert propose_ngram([1, 2, 9, 7, 2, 8, 1, 2], 2, 1, 2) == [9, 7]  # [1, 2] beats the later [2]
    assert propose_ngram([5, 2, 6, 2, 7, 2], 3, 1, 1) == [7, 2]  # most recent [2]; the context ends
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # no suffix occurs earlier
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == [] and propose_ngram([1], 3, 1, 2) == []
    assert propose_ngram([3, 1, 2, 4, 1, 2], 4, 3, 4) == []  # only a 2-gram repeats; min is 3


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, then the bonus
    assert accept_greedy([5, 9, 7], [5, 6]) == [5, 9]  # the target at the first mismatch
    assert accept_greedy([4, 6, 7], [5, 6]) == [4]
    assert accept_greedy([8], []) == [8]


def test_accept_sampled_keeps_the_target_distribution():
    """The first emitted token is distributed as p_0 whatever the draft is (Leviathan
    et al. ICML'23, Theorem 1, with a point-mass draft distribution)."""
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]])
    gen = torch.Generator().manual_seed(0)
    trials = 20000
    for draft in (0, 3, 4):  # likely, unlikely, impossible
        counts = torch.zeros(5)
        accepted = 0
        for _ in range(trials):
            u = torch.rand(2, generator=gen)
            tokens = accept_sampled(p, [draft], u[:1], float(u[1]), bonus=4)
            counts[tokens[0]] += 1
            accepted += len(tokens) == 2
        assert torch.allclose(counts / trials, p[0], atol=0.015), (draft, counts / trials)
        assert abs(accepted / trials - float(p[0, draft])) < 0.015


def _engine(spec: SpeculativeConfig | None, num_blocks: int = 128, **config) -> LLMEngine:
    tok = fake_tokenizer()
    runner = FakeRunner(num_blocks=num_blocks, block_size=4, special_ids=tok.special_token_ids, copying=True)
    return LLMEngine(runner, tok, EngineConfig(block_size=4, speculative=spec, **config), clock=ManualClock())


def _run(engine: LLMEngine, **params) -> dict:
    tok = fake_tokenizer()
    for i, prompt in enumerate(PROMPTS):
        assert engine.add_request(EngineRequest(f"r{i}", tok.encode(prompt), SamplingParams(**params))).ok
    results = drain(engine)
    assert_no_leaks(engine)
    return results


SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                         disable_by_batch_size=0)


@pytest.mark.parametrize("num_blocks", [128, 24], ids=["roomy", "preempting"])
def test_greedy_output_unchanged_and_drafts_accepted(num_blocks):
    params = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = _run(_engine(None, num_blocks), **params)
    engine = _engine(SPEC, num_blocks)
    spec = _run(engine, **params)
    assert {k: v.token_ids for k, v in spec.items()} == {k: v.token_ids for k, v in plain.items()}
    assert {k: v.text for k, v in spec.items()} == {k: v.text for k, v in plain.items()}
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert sum(r.finished_step for r in spec.values()) < sum(r.finished_step for r in plain.values())


def test_limits_hold_inside_accepted_drafts():
    """max_tokens, stop strings and stop token ids end the output at the same token
    as without drafts, even when the drafts ran past it."""
    for params in (dict(max_tokens=7), dict(max_tokens=40, stop=["o w"]), dict(max_tokens=40, stop_token_ids=[111])):
        params.update(temperature=0.0, ignore_eos=True)
        plain = _run(_engine(None), **params)
        spec = _run(_engine(SPEC), **params)
        for rid, r in plain.items():
            assert (spec[rid].token_ids, spec[rid].text, spec[rid].finish_reason) == \
                (r.token_ids, r.text, r.finish_reason), (params, rid)


def test_sampled_rows_speculate_and_finish():
    engine = _engine(SPEC)
    results = _run(engine, max_tokens=25, temperature=0.8, top_p=0.95, ignore_eos=True)
    assert all(len(r.token_ids) == 25 and r.finish_reason == "length" for r in results.values())
    assert engine.stats().spec_num_accepted_tokens > 0


def test_no_drafts_above_the_batch_size_limit_or_for_penalised_rows():
    engine = _engine(SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=len(PROMPTS) - 1))
    _run(engine, max_tokens=6, temperature=0.0, ignore_eos=True)  # all six decode together
    assert engine.stats().spec_num_draft_tokens == 0
    engine = _engine(SPEC)
    _run(engine, max_tokens=20, temperature=0.0, ignore_eos=True, frequency_penalty=0.5, logprobs=1)
    assert engine.stats().spec_num_draft_tokens == 0


def test_speculative_config_from_json():
    assert SpeculativeConfig.from_json("") is None and SpeculativeConfig.from_json("null") is None
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 3, 2)
    for bad in ("{", "[1]", '{"method": "eagle"}', '{"k": 1}', '{"prompt_lookup_min": 5}'):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_json(bad)


def test_failed_verifications_back_off_exponentially():
    from worker.engine.sequence import MAX_SPEC_BACKOFF, Sequence

    seq = Sequence(0, "r", [1, 2, 3], SamplingParams(), output_token_ids=[4] * 10)
    resume = []
    for _ in range(6):
        seq.record_verification(0)
        resume.append(seq.spec_resume_at - seq.num_output_tokens)
    assert resume == [1, 3, 7, 15, MAX_SPEC_BACKOFF, MAX_SPEC_BACKOFF]
    seq.record_verification(2)
    assert (seq.spec_misses, seq.spec_resume_at) == (0, seq.num_output_tokens)


class _NeverCopies(FakeRunner):
    """Outputs from four tokens (so n-gram drafts are found nearly every step), never
    the first token :data:`SPEC`'s lookup would draft (so every verification accepts
    nothing)."""

    def _logits(self, context: list[int]) -> torch.Tensor:
        row = torch.full((self.vocab_size,), -30.0)
        small = self.allowed[:4]
        choice = small[(sum(context[-2:]) * 7 + len(context)) % 4]
        draft = propose_ngram(context, 1, SPEC.prompt_lookup_min, SPEC.prompt_lookup_max)
        if draft and choice == draft[0]:
            choice = small[(small.index(choice) + 1) % 4]
        row[choice] = 10.0
        return row


def test_text_that_never_copies_stops_paying_for_drafts(monkeypatch):
    import worker.engine.sequence

    def drafts() -> int:
        tok = fake_tokenizer()
        runner = _NeverCopies(num_blocks=128, block_size=4, special_ids=tok.special_token_ids)
        engine = LLMEngine(runner, tok, EngineConfig(block_size=4, speculative=SPEC), clock=ManualClock())
        _run(engine, max_tokens=60, temperature=0.0, ignore_eos=True)
        return engine.stats().spec_num_draft_tokens

    with_backoff = drafts()
    monkeypatch.setattr(worker.engine.sequence, "MAX_SPEC_BACKOFF", 0)
    without = drafts()
    assert with_backoff < 0.3 * without, (with_backoff, without)
