"""bench/quant_accuracy.py: the fake quantizer's grid and the scheme swap on a tiny model."""

import pytest
import torch

from bench.quant_accuracy import SCHEMES, all_logits, fake_quantize, quantized
from worker.model.model_runner import tiny_random_runner


def test_fake_quantize_rounds_each_block_to_its_own_grid():
    x = torch.tensor([[1.0, -0.5, 0.26, 100.0, -50.0, 1.0]])
    per_row = fake_quantize(x, 8, None)
    per_block = fake_quantize(x, 8, 3)
    # One scale for the row: 100 / 127, so 0.26 falls to 0 and 1.0 to one step.
    assert per_row[0, 2] == 0 and per_row[0, 3] == pytest.approx(100.0)
    assert per_row[0, 0] == pytest.approx(100.0 / 127)
    # The first block's scale is 1 / 127: its values survive to within half a step.
    assert torch.allclose(per_block[0, :3], x[0, :3], atol=0.5 / 127)
    assert per_block[0, 4] == pytest.approx(-50.0, abs=0.5 * 100 / 127)
    with pytest.raises(ValueError):
        fake_quantize(x, 8, 4)


def test_schemes_change_the_logits_and_restore_the_model():
    runner = tiny_random_runner(seed=0, hidden_size=64, num_layers=2)
    ids = list(range(1, 20))
    before = all_logits(runner, ids)
    for scheme in SCHEMES:
        with quantized(runner.model, scheme):
            during = all_logits(runner, ids)
        assert during.shape == before.shape
        assert not torch.equal(during, before), scheme.name
        assert torch.equal(all_logits(runner, ids), before), scheme.name  # restored
