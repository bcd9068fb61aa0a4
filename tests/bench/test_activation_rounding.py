"""bench/activation_rounding.py: every product of a forward pass is one of the projections
``--by-projection`` names, and rounding one kind changes the logits while the others stay exact."""

from unittest import mock

import torch

import worker.model.llama as llama
from bench.activation_rounding import PROJECTIONS, cases, projection_kinds, round_activations
from bench.quant_accuracy import all_logits
from worker.model.model_runner import tiny_random_runner


def test_every_product_has_a_projection_kind_and_each_kind_is_used():
    runner = tiny_random_runner(seed=0, hidden_size=64, num_layers=2)
    kinds, seen = projection_kinds(runner.model), []
    plain = llama.linear

    def recording(x, weight, bias=None):
        seen.append(kinds.get(id(weight)))
        return plain(x, weight, bias)

    with mock.patch.object(llama, "linear", recording):
        all_logits(runner, list(range(1, 12)))
    assert None not in seen
    assert set(seen) == set(PROJECTIONS)


def test_by_projection_cases_are_the_int8_roundings_once_per_kind():
    rows = cases(by_projection=True)
    assert len(rows) == 2 * len(PROJECTIONS)
    assert all(bits == 8 and kind in PROJECTIONS for _, bits, _, kind in rows)
    assert all(kind is None for *_, kind in cases(by_projection=False))


def test_rounding_only_the_down_inputs_moves_the_logits():
    runner = tiny_random_runner(seed=0, hidden_size=64, num_layers=2)
    kinds, ids = projection_kinds(runner.model), list(range(1, 12))
    before = all_logits(runner, ids)
    plain = llama.linear

    def down_only(x, weight, bias=None):
        return plain(round_activations(x, 8, 32) if kinds[id(weight)] == "down" else x, weight, bias)

    with mock.patch.object(llama, "linear", down_only):
        after = all_logits(runner, ids)
    assert not torch.equal(after, before)
