"""LLMEngine over the real ModelRunner (tiny random Llama) and the real
SmolLM2 tokenizer."""

import pytest

from tests.worker.engine_helpers import assert_no_leaks, drain
from worker.engine.engine_config import EngineConfig
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.sampling_params import SamplingParams

PROMPTS = ["Hello, my name is", "你好，世界！今天", "🚀 to the moon and", "The capital of France is"]


@pytest.fixture(scope="module")
def tokenizer():
    from common.model_files import default_model_path
    from common.tokenizer import load_tokenizer

    try:
        return load_tokenizer(default_model_path())
    except (FileNotFoundError, ModuleNotFoundError) as exc:  # model package not installed
        pytest.skip(f"default model files unavailable: {exc}")


@pytest.fixture(params=["float32", "float16"], ids=lambda kv: f"kv-{kv}")
def kv_cache(request):
    """The runner's cache: float32, or float16 under float32 compute with a head
    size the compiled CPU kernel takes (the default cache on such a CPU)."""
    return request.param


def _engine(tokenizer, num_blocks, kv_cache="float32", **config):
    import torch

    from worker.model.model_runner import tiny_random_runner

    shape = {} if kv_cache == "float32" else dict(hidden_size=128, num_heads=2, num_kv_heads=1)  # head_dim 64
    runner = tiny_random_runner(vocab_size=tokenizer.vocab_size, block_size=16, num_blocks=num_blocks,
                                kv_cache_dtype=getattr(torch, kv_cache), **shape)
    return LLMEngine(runner, tokenizer, EngineConfig(block_size=16, **config))


def _run(engine, tokenizer, max_tokens=20, **params):
    for i, p in enumerate(PROMPTS):
        req = EngineRequest(f"r{i}", tokenizer.encode(p), SamplingParams(max_tokens=max_tokens, **params))
        assert engine.add_request(req).ok
    results = drain(engine)
    assert_no_leaks(engine)
    return results


def test_greedy_streams_equal_one_shot_decode(tokenizer):
    results = _run(_engine(tokenizer, 64), tokenizer, temperature=0.0, ignore_eos=True)
    for r in results.values():
        assert len(r.token_ids) == 20 and r.finish_reason == "length"
        assert r.text == tokenizer.decode(r.token_ids)


def test_batched_equals_alone_and_preemption_recomputes(tokenizer, kv_cache):
    big = _run(_engine(tokenizer, 64, kv_cache), tokenizer, max_tokens=16, temperature=0.0, ignore_eos=True)
    small_engine = _engine(tokenizer, 5, kv_cache)  # 80 slots: the 4 requests (~24 tokens each) do not all fit
    small = _run(small_engine, tokenizer, max_tokens=16, temperature=0.0, ignore_eos=True)
    assert small_engine.stats().num_preemptions > 0
    assert {k: v.token_ids for k, v in small.items()} == {k: v.token_ids for k, v in big.items()}


def test_seeded_sampling_with_real_runner(tokenizer, kv_cache):
    kw = dict(max_tokens=12, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    a = _run(_engine(tokenizer, 64, kv_cache), tokenizer, **kw)
    b = _run(_engine(tokenizer, 64, kv_cache, max_num_batched_tokens=8), tokenizer, **kw)
    assert {k: v.token_ids for k, v in a.items()} == {k: v.token_ids for k, v in b.items()}
