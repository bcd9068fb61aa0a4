"""Continuations over real Llama math (issue 8, "worker dies after XACK"): a
request resumed from any point with the tokens and text its client already had
produces exactly the rest of the uninterrupted output, greedy or seeded, with
nothing repeated, and reports the whole completion in its usage."""

import random

import pytest
import torch

from tests.worker.engine_helpers import assert_no_leaks
from tests.worker.fakes import fake_tokenizer
from worker.engine.engine_config import EngineConfig
from worker.engine.engine import AddStatus, EngineRequest, LLMEngine
from worker.engine.sampling_params import SamplingParams

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tok():
    return fake_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    from worker.model.model_runner import tiny_random_runner

    runner = tiny_random_runner(vocab_size=tok.vocab_size, block_size=16, num_blocks=64, dtype=torch.float32)
    return LLMEngine(runner, tok, EngineConfig(block_size=16))


@pytest.fixture(scope="module")
def prompt(tok):
    rng = random.Random(8)
    ids = [t for t in range(tok.vocab_size) if t not in tok.special_token_ids]
    return [rng.choice(ids) for _ in range(21)]


def _run(engine, request):
    """(token ids, text deltas per token, last output) of one request run alone."""
    assert engine.add_request(request).ok
    tokens, texts, last = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
            texts.append(out.text_delta)
            last = out
    return tokens, texts, last


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=1234)],
                         ids=["greedy", "seeded"])
def test_resumed_request_continues_the_uninterrupted_output(engine, prompt, sampling):
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    ref_tokens, ref_texts, _ = _run(engine, EngineRequest("ref", list(prompt), params))
    assert len(ref_tokens) == MAX_TOKENS
    for split in (1, 4, MAX_TOKENS - 1):
        resumed = EngineRequest(f"cont{split}", list(prompt), params, resumed_token_ids=ref_tokens[:split],
                                resumed_text="".join(ref_texts[:split]))
        tokens, texts, last = _run(engine, resumed)
        assert tokens == ref_tokens[split:], split
        assert "".join(ref_texts[:split]) + "".join(texts) == "".join(ref_texts), split
        assert last.finish_reason == "length" and last.completion_tokens == MAX_TOKENS
        assert last.prompt_tokens == len(prompt)
    assert_no_leaks(engine)


def test_a_continuation_without_budget_left_is_refused(engine, prompt):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    result = engine.add_request(EngineRequest("full", list(prompt), params, resumed_token_ids=[5, 6, 7]))
    assert result.status is AddStatus.INVALID and "max_tokens" in result.reason
