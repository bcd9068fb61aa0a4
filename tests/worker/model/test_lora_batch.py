"""worker/model/lora_batch.py: the grouped product (the CPU kernel) against the masked torch
product on the same step, in float32 and bfloat16 compute, with base rows and several adapters
of different modules and ranks mixed; base rows keep the base projection's values."""

from __future__ import annotations

import pytest
import torch

import inflight_kernels
from worker.model.lora import PROJECTIONS, LoraAdapter, LoraModule, module_slices
from worker.model.lora_batch import LoraStacks
from worker.model.model_config import ModelConfig

pytestmark = pytest.mark.skipif(not inflight_kernels.cpu_kernels_available(), reason="CPU kernels not built")

CONFIG = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=256, context_length=256)


def adapter(name: str, rank: int, modules: tuple[str, ...], seed: int, dtype: torch.dtype) -> LoraAdapter:
    """A random adapter of ``CONFIG`` adapting ``modules`` with rank ``rank``."""
    gen = torch.Generator().manual_seed(seed)
    slices = module_slices(CONFIG)
    layers = []
    for _ in range(CONFIG.num_layers):
        entry = {}
        for module in modules:
            _, start, end, d_in = slices[module]
            entry[module] = LoraModule((torch.randn(d_in, rank, generator=gen) / d_in ** 0.5).to(dtype),
                                       torch.randn(rank, end - start, generator=gen).to(dtype))
        layers.append(entry)
    ordered = tuple(m for m in slices if m in modules)
    return LoraAdapter(name, f"/adapters/{name}", rank, 1.0, ordered, layers, name)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_equals_masked(dtype, tolerance):
    adapters = [adapter("a", 8, ("q_proj", "v_proj", "down_proj"), 1, dtype),
                adapter("b", 4, ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj"), 2, dtype)]
    slots = torch.tensor([0, -1, 1, 1, 0, -1, 1], dtype=torch.int64)
    grouped, masked = LoraStacks(CONFIG), LoraStacks(CONFIG)
    masked.grouped = False
    g, m = grouped.batch(adapters, slots), masked.batch(adapters, slots)
    assert g.row_slots is not None and m.row_slots is None
    widths = {"qkv": (64, 64 + 2 * 32), "o": (64, 64), "gate_up": (64, 192), "down": (96, 64)}
    gen = torch.Generator().manual_seed(0)
    for layer in range(CONFIG.num_layers):
        for projection in PROJECTIONS:
            d_in, d_out = widths[projection]
            x = torch.randn(len(slots), d_in, generator=gen).to(dtype)
            base = torch.randn(len(slots), d_out, generator=gen).to(dtype)
            got = g.apply(layer, projection, x, base.clone())
            want = m.apply(layer, projection, x, base.clone())
            assert got.dtype == dtype
            scale = want.float().abs().max()
            assert ((got.float() - want.float()).abs().max() / scale).item() < tolerance, (layer, projection)
            assert torch.equal(got[slots < 0], base[slots < 0])
