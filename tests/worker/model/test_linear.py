"""worker.model.linear: prepacked oneDNN projections give F.linear's results; our
bf16 kernel (BF16Weight, where the CPU has AVX-512 BF16) gives the exact product
rounded once to bfloat16, up to float32 summation error."""

import pytest
import torch
import torch.nn.functional as F

import inflight_kernels

from worker.model.dtype import cpu_has_amx
from worker.model.linear import BF16Weight, can_pack, linear, pack, uses_bf16_kernel
from worker.model.model_runner import tiny_random_runner

needs_pack = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="oneDNN has no bf16 kernels on this CPU")


@needs_pack
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 129])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (3072, 576), (256, 64)])
def test_packed_bf16_equals_f_linear(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    packed = pack(w)
    assert packed.shape == w.shape
    if uses_bf16_kernel(torch.bfloat16, torch.device("cpu")):
        assert isinstance(packed, BF16Weight)
        for got, bias in ((linear(x, packed), None), (linear(x, packed, b), b)):
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            assert got.dtype == torch.bfloat16 and got.shape == exact.shape
            # one bf16 rounding (half an ulp: 2^-8 relative) plus float32 sums' error
            assert torch.allclose(got.double(), exact, rtol=2 ** -8, atol=1e-4 * in_features ** 0.5)
        return
    assert packed.layout == torch._mkldnn
    ref = x.expand(2, -1) if rows == 1 else x  # one row runs as two (batch invariance, below)
    with torch.inference_mode():
        assert torch.equal(linear(x, packed), F.linear(ref, w)[:rows])
        assert torch.equal(linear(x, packed, b), F.linear(ref, w, b)[:rows])


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 129])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (3072, 576)])
def test_packed_float32_matches_f_linear(rows, out_features, in_features):
    """fp32 packing changes only the summation order."""
    assert can_pack(torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    packed = pack(w)
    assert packed.layout == torch._mkldnn and packed.shape == w.shape
    with torch.inference_mode():
        for got, want in ((linear(x, packed), F.linear(x, w)), (linear(x, packed, b), F.linear(x, w, b))):
            assert got.shape == want.shape and got.dtype == torch.float32
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * in_features**0.5)


def test_plain_weights_and_float16_are_not_packed():
    assert not can_pack(torch.float16, torch.device("cpu"))
    assert not can_pack(torch.float32, torch.device("meta"))
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(linear(x, w), F.linear(x, w))
    runner = tiny_random_runner(dtype=torch.float16)
    assert not runner.model.packed and runner.model.layers[0].qkv.layout == torch.strided


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_decoder_matches_unpacked_logits(dtype):
    """The same tiny model with and without packing: same logits for a prefill and a decode
    (bit-equal in bf16, equal up to summation order in fp32)."""
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    from worker.runner_io import ModelInput, ScheduledChunk
    from worker.model.kv_cache import KVCache, KVCacheSpec
    from worker.model.llama import LlamaDecoder
    from worker.model.random_weights import random_llama_weights
    from worker.model.model_runner import ModelRunner

    config = tiny_random_runner().config
    weights = random_llama_weights(config, 0)
    runners = []
    for pack_weights in (True, False):
        model = LlamaDecoder.from_weights(config, weights, dtype, "cpu", pack=pack_weights)
        assert model.packed == pack_weights
        spec = KVCacheSpec(config.num_layers, config.num_kv_heads, 16, config.head_dim, dtype)
        runners.append(ModelRunner(model, KVCache.allocate(spec, num_blocks=8, budget_bytes=None, device="cpu")))
    ours = isinstance(runners[0].model.lm_head, BF16Weight)
    assert (ours or runners[0].model.lm_head.layout == torch._mkldnn) and runners[1].model.lm_head.layout == torch.strided
    prefill = ModelInput(prefills=[ScheduledChunk(0, [1, 2, 3, 4, 5], 0, [0])])
    decode = ModelInput(decodes=[ScheduledChunk(0, [6], 5, [0])])
    for step in (prefill, decode):
        packed, plain = (runner.execute(step).logits for runner in runners)
        if dtype == torch.bfloat16 and ours:  # our kernel sums in another order than oneDNN's
            assert torch.allclose(packed, plain, rtol=0.05, atol=0.05)
        elif dtype == torch.bfloat16:
            assert torch.equal(packed, plain)
        else:
            assert torch.allclose(packed, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (3072, 576)])
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call(dtype, out_features, in_features):
    """Batch invariance: row 0 alone gives the bits it gives among 2..40 rows (oneDNN's
    one-row kernel sums in another order; worker/model/linear.py runs one row as two)."""
    if not can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"no oneDNN {dtype} kernels on this CPU")
    if dtype == torch.bfloat16 and cpu_has_amx() and not uses_bf16_kernel(dtype, torch.device("cpu")):
        pytest.skip("oneDNN's AMX bf16 kernels change their blocking past 32 rows (--deterministic refuses them, "
                    "worker/model/determinism.py)")
    g = torch.Generator().manual_seed(1)
    w = pack(torch.randn(out_features, in_features, generator=g).to(dtype))
    x = torch.randn(40, in_features, generator=g).to(dtype)
    with torch.inference_mode():
        alone = linear(x[:1], w)
        assert alone.shape == (1, out_features)
        for rows in range(2, 41):
            assert torch.equal(linear(x[:rows], w)[:1], alone), rows


@needs_pack
def test_an_amx_cpu_keeps_onednn_for_bf16(monkeypatch):
    """Where oneDNN multiplies bf16 on AMX tiles, the weights stay oneDNN's."""
    import worker.model.linear as linear_module

    monkeypatch.setattr(linear_module, "cpu_has_amx", lambda: True)
    packed = pack(torch.randn(32, 64).bfloat16())
    assert not isinstance(packed, BF16Weight) and packed.layout == torch._mkldnn


@pytest.mark.skipif(not uses_bf16_kernel(torch.bfloat16, torch.device("cpu")), reason="no bf16 kernel of ours here")
@pytest.mark.parametrize("out_features,in_features", [(1, 2), (13, 64), (100, 30), (17, 576), (79, 64)])
def test_bf16_kernel_on_partial_tiles(out_features, in_features):
    """Widths that are not a multiple of 16 (masked stores) or of 64 (partial tile groups),
    for several row counts: the exact product rounded once, nothing written past the
    output's width (the unpacked weight round-trips too)."""
    from bench.quant_accuracy import _plain

    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g)
    packed = pack(w)
    assert isinstance(packed, BF16Weight) and torch.equal(_plain(packed), w)
    for rows in (1, 3, 5, 67):
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        got = linear(x, packed, b)
        exact = x.double() @ w.double().T + b.double()
        assert got.shape == (rows, out_features)
        assert torch.allclose(got.double(), exact, rtol=2 ** -8, atol=1e-4 * in_features ** 0.5)


@pytest.mark.skipif(not inflight_kernels.cpu_bf16_gemm(), reason="no AVX-512 BF16 build on this CPU")
@pytest.mark.parametrize("out_features,in_features", [(13, 64), (79, 576)])
def test_bf16_kernel_float32_output_keeps_the_sums_unrounded(out_features, in_features):
    """``out_dtype=float32`` (the dense copies of GGUF blocks, worker.model.dense_weights.with_dense):
    the float32 sums themselves, which the bfloat16 output only rounds."""
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    packed = inflight_kernels.bf16_pack_weight(w)
    for rows in (1, 5, 67):
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        got = inflight_kernels.bf16_linear(x, packed, out_features, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        assert torch.allclose(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.bfloat16(), inflight_kernels.bf16_linear(x, packed, out_features))
