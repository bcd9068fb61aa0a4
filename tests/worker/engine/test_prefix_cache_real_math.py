"""Prefix caching and preemption over real Llama math (issue 4, "done means"):
with greedy decoding in float32 on a tiny random GQA Llama, requests sharing
a long prompt prefix (several full blocks) give identical tokens with the
prefix cache cold and warm, and with and without forced preemption."""

import random

import pytest
import torch

from tests.worker.engine_helpers import assert_no_leaks
from tests.worker.fakes import fake_tokenizer
from worker.engine.engine_config import EngineConfig
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.sampling_params import SamplingParams

BLOCK = 16
PREFIX_BLOCKS = 4  # shared prefix: 64 tokens = 4 full blocks
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tok():
    return fake_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    rng = random.Random(4)
    ids = [t for t in range(tok.vocab_size) if t not in tok.special_token_ids]
    prefix = [rng.choice(ids) for _ in range(PREFIX_BLOCKS * BLOCK)]
    # unique tails of different lengths (one ends exactly on a block edge)
    return [prefix + [rng.choice(ids) for _ in range(n)] for n in (5, 16, 9, 23)]


def _engine(tok, num_blocks: int, **config) -> LLMEngine:
    from worker.model.model_runner import tiny_random_runner

    runner = tiny_random_runner(vocab_size=tok.vocab_size, block_size=BLOCK, num_blocks=num_blocks,
                                dtype=torch.float32)
    assert runner.config.num_kv_heads < runner.config.num_heads  # GQA
    return LLMEngine(runner, tok, EngineConfig(block_size=BLOCK, **config))


def _tokens(engine: LLMEngine, prompts, tag: str):
    """Run ``prompts`` to completion; returns ({index: tokens}, {index: cached prompt tokens})."""
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert engine.add_request(EngineRequest(f"{tag}{i}", list(p), params)).ok
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            key = out.request_id[len(tag):]
            tokens.setdefault(key, []).extend(out.token_ids)
            if out.finished:
                assert out.finish_reason == "length"
                cached[key] = out.cached_prompt_tokens
    assert not engine.has_unfinished()
    assert all(len(t) == MAX_TOKENS for t in tokens.values()) and len(tokens) == len(prompts)
    return tokens, cached


def test_prefix_cache_cold_warm_and_preemption_give_identical_tokens(tok, prompts):
    # reference: plenty of blocks, no prefix cache
    ref_engine = _engine(tok, 64, enable_prefix_caching=False)
    ref, ref_cached = _tokens(ref_engine, prompts, "ref")
    assert all(c == 0 for c in ref_cached.values())
    assert ref_engine.stats().num_preemptions == 0
    assert_no_leaks(ref_engine)

    # (a) prefix cache on: first run (cold), then the same prompts again (warm)
    eng = _engine(tok, 64)
    cold, _ = _tokens(eng, prompts, "cold")
    warm, warm_cached = _tokens(eng, prompts, "warm")
    assert cold == ref and warm == ref
    assert all(c >= PREFIX_BLOCKS * BLOCK for c in warm_cached.values()), warm_cached
    assert all(c < len(p) for c, p in zip(warm_cached.values(), prompts))  # last token always recomputed
    assert eng.stats().prefix_cache_hits > 0 and eng.stats().prefix_cache_hit_ratio > 0
    assert eng.stats().num_preemptions == 0
    assert_no_leaks(eng)

    # (b) forced preemption: 10 blocks (160 slots) for four requests of 81..99
    # tokens each (5-6 blocks alone, 4 shared + 2 each with the prefix
    # cache): prompts are admitted, decode growth runs out of blocks; with
    # and without the prefix cache
    for pc in (False, True):
        small = _engine(tok, 10, enable_prefix_caching=pc)
        out, _ = _tokens(small, prompts, f"small{pc}")
        assert small.stats().num_preemptions > 0, pc
        assert out == ref, pc
        if pc:  # warm again after preemption, still the same tokens
            again, again_cached = _tokens(small, prompts, "again")
            assert again == ref and sum(again_cached.values()) > 0
        assert_no_leaks(small)


def test_a_shared_block_at_another_position_is_not_reused(tok):
    """Block hashes are chained to the whole prefix: prompt B starts with the two
    blocks that sit in the middle of prompt A (after a block of its own), so equal
    block contents but different prefixes (and positions). With A's blocks cached,
    B must hit nothing and decode exactly as on a cold engine; an unchained hash
    (one of the block's tokens alone) would hand B A's K/V, computed under another
    context at other positions, and change its tokens."""
    rng = random.Random(50)
    ids = [t for t in range(tok.vocab_size) if t not in tok.special_token_ids]
    own, middle = ([rng.choice(ids) for _ in range(n)] for n in (BLOCK, 2 * BLOCK))
    prompt_a = own + middle + [rng.choice(ids) for _ in range(5)]
    prompt_b = middle + [rng.choice(ids) for _ in range(7)]

    cold, cold_cached = _tokens(_engine(tok, 32, enable_prefix_caching=False), [prompt_b], "cold")
    warm_engine = _engine(tok, 32)
    _tokens(warm_engine, [prompt_a], "a")
    assert warm_engine.stats().num_cached_blocks >= 3  # A's own block and the two middle ones
    warm, warm_cached = _tokens(warm_engine, [prompt_b], "b")
    assert warm == cold  # the tokens first: what a user would see
    assert warm_cached == cold_cached == {"0": 0}
    assert_no_leaks(warm_engine)
