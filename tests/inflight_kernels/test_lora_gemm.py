"""The batched LoRA product grouped by adapter (``inflight_kernels/cpu/lora_gemm.cpp``) against
its float64 oracle (``inflight_kernels.reference.lora_apply``): adapters of different ranks and
modules in one call, base rows left bit for bit, each row's result independent of its batch,
widths that are not multiples of the vector width, and bad arguments refused."""

from __future__ import annotations

import pytest
import torch

import inflight_kernels
from inflight_kernels import reference
from inflight_kernels.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(not inflight_kernels.cpu_kernels_available(), reason="CPU kernels not built")


def make_case(rows: int, d_in: int, outs: tuple[int, ...], ranks: tuple[int, ...], seed: int = 0):
    """x, a_t, pieces, b_ts for ``len(ranks)`` adapters each adapting every module of a fused
    projection whose modules have output widths ``outs``: ``a_t``'s columns module by module,
    each module's adapters side by side (as worker/model/lora_batch.py lays them out)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=gen)
    pieces, b_ts, a_cols, col, out_start = [], [], [], 0, 0
    for width in outs:
        for slot, rank in enumerate(ranks):
            a_cols.append(torch.randn(d_in, rank, generator=gen) / d_in ** 0.5)
            b_ts.append(torch.randn(rank, width, generator=gen))
            pieces.append((slot, out_start, out_start + width, col, col + rank))
            col += rank
        out_start += width
    return x, torch.cat(a_cols, dim=1).contiguous(), torch.tensor(pieces, dtype=torch.int64), b_ts


@pytest.mark.parametrize("rows", [1, 5, 9, 32])
def test_each_row_gets_only_its_adapters_delta(rows):
    x, a_t, pieces, b_ts = make_case(rows, 72, (40, 24, 24), (16, 8, 5))
    slots = torch.tensor([(r % 4) - 1 for r in range(rows)], dtype=torch.int64)  # -1, 0, 1, 2, -1, ...
    base = torch.randn(rows, 88, generator=torch.Generator().manual_seed(1))
    out = inflight_kernels.lora_apply(base.clone(), x, slots, a_t, pieces, b_ts)
    expected = reference.lora_apply(base.double().clone(), x, slots, a_t, pieces, b_ts).float()
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
    base_rows = slots < 0
    assert torch.equal(out[base_rows], base[base_rows])  # + nothing, not + 0.0 computed


def test_a_rows_result_does_not_depend_on_the_batch():
    """Batch invariance: a row computed with 11 others of mixed adapters equals it alone, bit for bit."""
    x, a_t, pieces, b_ts = make_case(12, 96, (48, 16), (16, 16, 32))
    slots = torch.tensor([0, 1, 0, 2, 2, 2, 0, -1, 1, 0, 2, 1], dtype=torch.int64)
    together = cpu_ops.lora_apply(torch.zeros(12, 64), x, slots, a_t, pieces, b_ts)
    for r in range(12):
        alone = cpu_ops.lora_apply(torch.zeros(1, 64), x[r:r + 1].contiguous(), slots[r:r + 1].contiguous(),
                                   a_t, pieces, b_ts)
        assert torch.equal(alone[0], together[r])


def test_a_column_slice_of_a_wider_output_and_a_slot_without_rows():
    x, a_t, pieces, b_ts = make_case(3, 32, (20,), (4, 4))
    wide = torch.full((3, 26), 3.0)
    slots = torch.tensor([1, 1, -1], dtype=torch.int64)  # slot 0 has no row in this step
    cpu_ops.lora_apply(wide[:, 2:22], x, slots, a_t, pieces, b_ts)
    expected = reference.lora_apply(torch.full((3, 20), 3.0, dtype=torch.float64), x, slots, a_t, pieces, b_ts)
    assert torch.allclose(wide[:, 2:22], expected.float(), rtol=1e-5, atol=1e-5)
    assert torch.all(wide[:, :2] == 3.0) and torch.all(wide[:, 22:] == 3.0) and torch.all(wide[2, 2:22] == 3.0)


def test_bad_arguments_raise():
    x, a_t, pieces, b_ts = make_case(2, 32, (16,), (8,))
    slots = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="a_t"):
        cpu_ops.lora_apply(torch.zeros(2, 16), x, slots, a_t[:16].contiguous(), pieces, b_ts)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.lora_apply(torch.zeros(2, 8), x, slots, a_t, pieces, b_ts)
    with pytest.raises(RuntimeError, match="B of piece 0"):
        cpu_ops.lora_apply(torch.zeros(2, 16), x, slots, a_t, pieces, [b_ts[0][:, :8]])
    with pytest.raises(RuntimeError, match="row_slots"):
        cpu_ops.lora_apply(torch.zeros(2, 16), x, slots.int(), a_t, pieces, b_ts)
