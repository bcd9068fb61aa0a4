"""Speculative decoding (n-gram drafts) on the real SmolLM2: greedy tokens are the
same with and without it, in each compute dtype and with q8_0 weights, on prompts
where prompt lookup pays (the answer copies the prompt), and drafts are accepted."""

from __future__ import annotations

import pytest

from common.model_files import default_model_path
from common.tokenizer import load_tokenizer
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.engine_config import EngineConfig, SpeculativeConfig
from worker.engine.sampling_params import SamplingParams
from worker.model.model_runner import load_model_runner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PASSAGE = ("The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and children "
           "were playing football near the old oak tree while their parents watched from the benches.")
TASKS = ["Repeat the following text exactly, word for word:\n\n" + PASSAGE,
         "Rewrite this text in the past tense, changing nothing else:\n\nThe dog runs to the gate. "
         "The dog barks at the cat. The cat runs up the tree. The dog waits under the tree.",
         "What is the capital of France?"]


def _tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=40, temperature=0.0)
        assert engine.add_request(EngineRequest(f"r{i}", prompt, params)).ok
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype,quantization", [("auto", "auto"), ("float32", "none"), ("bfloat16", "none"),
                                                ("float32", "q8_0")])
def test_greedy_tokens_equal_with_ngram_drafts(dtype, quantization):
    path = default_model_path()
    if not path.exists():
        pytest.skip(f"no model at {path}")
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}], add_generation_prompt=True) for t in TASKS]
    runner = load_model_runner(path, dtype=dtype, quantization=quantization, num_blocks=256)
    plain = _tokens(LLMEngine(runner, tokenizer, EngineConfig(num_blocks=256)), prompts)
    engine = LLMEngine(runner, tokenizer, EngineConfig(num_blocks=256, speculative=SpeculativeConfig()))
    assert _tokens(engine, prompts) == plain
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens > 0, stats
