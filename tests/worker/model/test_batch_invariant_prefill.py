"""A prompt's logits must not depend on how its prefill was cut (issue 24 item 5):
a prefix-cache hit recomputes only the tail after the cached full blocks,
chunked prefill cuts anywhere, a continuation re-prefills what was decoded.
With the compiled CPU attention kernel each row attends alone over the pages,
so all of these give the same bits as one whole prefill."""

from __future__ import annotations

import pytest
import torch

from inflight_kernels.cpu import ops as cpu_ops
from worker.model.model_runner import tiny_random_runner
from worker.runner_io import ModelInput, ScheduledChunk

CASES = [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)]


def _runner(dtype, kv):
    if not cpu_ops.fast_attention():
        pytest.skip("the compiled CPU attention kernel is not built here")
    runner = tiny_random_runner(seed=7, dtype=dtype, kv_cache_dtype=kv, hidden_size=128, num_heads=4,
                                num_kv_heads=2, num_layers=3)
    assert runner.config.head_dim in cpu_ops.HEAD_DIMS  # the compiled kernel's path
    return runner


def _prefill(runner, seq, prompt, table, cuts):
    """Logits of ``prompt``'s last token, prefilled in chunks ending at ``cuts``."""
    start, logits = 0, None
    for end in [*cuts, len(prompt)]:
        out = runner.execute(ModelInput(prefills=[ScheduledChunk(seq, prompt[start:end], start, table,
                                                                  needs_logits=end == len(prompt))]))
        start = end
        logits = out.logits
    return logits[0]


@pytest.mark.parametrize("dtype,kv", CASES, ids=lambda d: str(d).removeprefix("torch."))
def test_prefix_hit_chunked_prefill_and_decode_give_the_bits_of_one_prefill(dtype, kv):
    runner = _runner(dtype, kv)
    prompt = [(i * 37 + 11) % runner.vocab_size for i in range(51)]
    whole = _prefill(runner, 0, prompt, list(range(0, 4)), [])
    # A prefix-cache hit: blocks 0..2 hold the first 48 tokens' K/V, only the tail runs.
    hit = _prefill(runner, 0, prompt, list(range(0, 4)), [48])
    assert torch.equal(hit, whole)
    for cuts in ([16], [5, 23], [50]):  # chunked prefill, other blocks, cuts anywhere
        assert torch.equal(_prefill(runner, 1, prompt, list(range(4, 8)), cuts), whole), cuts
    _prefill(runner, 2, prompt[:-1], list(range(8, 12)), [])
    decoded = runner.execute(ModelInput(decodes=[ScheduledChunk(2, prompt[-1:], 50, list(range(8, 12)))])).logits[0]
    assert torch.equal(decoded, whole)


@pytest.mark.parametrize("dtype,kv", CASES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_rows_prefill_output_does_not_depend_on_the_other_prefills_in_the_step(dtype, kv):
    runner = _runner(dtype, kv)
    a = [(i * 13 + 5) % runner.vocab_size for i in range(40)]
    b = [(i * 29 + 3) % runner.vocab_size for i in range(70)]
    alone = runner.execute(ModelInput(prefills=[ScheduledChunk(0, a, 0, list(range(0, 3)))])).logits[0]
    both = runner.execute(ModelInput(prefills=[ScheduledChunk(1, b, 0, list(range(3, 8))),
                                               ScheduledChunk(2, a, 0, list(range(8, 11)))])).logits
    assert torch.equal(both[1], alone)
