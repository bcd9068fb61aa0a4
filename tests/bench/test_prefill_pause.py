"""bench.prefill_pause on the tiny random model: the long prompt is chunked by the budget."""

from bench.prefill_pause import measure
from bench.targets.engine import EngineTargetSettings, load


def test_the_budget_sets_the_number_of_prefill_steps():
    runner, tokenizer = load(EngineTargetSettings(model="tiny"))
    wide = measure(runner, tokenizer, budget=64, prompt_tokens=40, streams=2)
    narrow = measure(runner, tokenizer, budget=10, prompt_tokens=40, streams=2)
    assert wide["steps"] == 1  # 2 decode tokens + the 40-token prompt fit one step of 64
    assert narrow["steps"] == 5  # 8 prompt tokens a step beside the 2 decode tokens
    for row in (wide, narrow):
        assert row["max_step_s"] <= row["ttft_s"] and row["prompt_tokens"] == 40


def test_a_threshold_lets_the_short_prompt_in_beside_the_long_prefill():
    """The short prompt arrives one step after the long one: without a threshold it
    waits for the long prefill's chunks; with one it is prefilled beside them."""
    runner, tokenizer = load(EngineTargetSettings(model="tiny"))
    waits = measure(runner, tokenizer, budget=34, prompt_tokens=320, streams=2)
    overtakes = measure(runner, tokenizer, budget=34, prompt_tokens=320, streams=2, threshold=8)
    assert waits["steps"] == 10 and overtakes["steps"] == 40  # 32 then 8 prompt tokens a step
    assert overtakes["short_ttft_s"] < overtakes["ttft_s"]  # done while the long one still prefills
