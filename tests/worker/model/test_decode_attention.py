"""worker.model.attention.decode_attention against the kernels.reference oracle."""

import pytest
import torch

from kernels import reference
from worker.model.attention import decode_attention


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(40, 3, 16, 64, generator=g).to(dtype)
    value_cache = torch.randn(40, 3, 16, 64, generator=g).to(dtype)
    tables = torch.randint(0, 40, (5, 6), generator=g, dtype=torch.int64).to(torch.int32)
    lens = torch.tensor([1, 17, 96, 0, 50], dtype=torch.int32)
    query = torch.randn(5, 9, 64, generator=g).to(dtype)
    return query, key_cache, value_cache, tables, lens


def test_float32_is_the_reference_exactly():
    q, kc, vc, tables, lens = _case(torch.float32)
    ref = reference.paged_attention(q, kc, vc, tables, lens, 0.125)
    assert torch.equal(decode_attention(q, kc, vc, tables, lens, 0.125, torch.empty_like(q)), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_reference(dtype):
    q, kc, vc, tables, lens = _case(dtype, seed=1)
    ref = reference.paged_attention(q, kc, vc, tables, lens, 0.125).float()
    out = decode_attention(q, kc, vc, tables, lens, 0.125, torch.empty_like(q))
    assert out.dtype == dtype
    assert torch.allclose(out.float(), ref, atol=3e-2, rtol=3e-2)
    assert torch.count_nonzero(out[3]) == 0  # context 0 -> zeros
