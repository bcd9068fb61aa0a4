"""worker.model.linear: prepacked oneDNN projections give F.linear's results."""

import pytest
import torch
import torch.nn.functional as F

from worker.model.linear import can_pack, linear, pack
from worker.model_runner import tiny_random_runner

needs_pack = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="oneDNN has no bf16 kernels on this CPU")


@needs_pack
@pytest.mark.parametrize("rows", [0, 1, 7, 32, 129])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (3072, 576), (256, 64)])
def test_packed_equals_f_linear(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    packed = pack(w)
    assert packed.layout == torch._mkldnn and packed.shape == w.shape
    with torch.inference_mode():
        assert torch.equal(linear(x, packed), F.linear(x, w))
        assert torch.equal(linear(x, packed, b), F.linear(x, w, b))


def test_plain_weights_and_float32_are_not_packed():
    assert not can_pack(torch.float32, torch.device("cpu"))
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    assert torch.equal(linear(x, w), F.linear(x, w))
    runner = tiny_random_runner(dtype=torch.float32)
    assert not runner.model.packed and runner.model.layers[0].qkv.layout == torch.strided


@needs_pack
def test_packed_decoder_matches_unpacked_logits():
    """The same tiny bf16 model with and without packing: same logits for a prefill and a decode."""
    from worker.batch import ModelInput, ScheduledChunk
    from worker.kv_cache import KVCache, KVCacheSpec
    from worker.model.llama import LlamaDecoder
    from worker.model.random_weights import random_llama_weights
    from worker.model_runner import ModelRunner

    config = tiny_random_runner().config
    weights = random_llama_weights(config, 0)
    runners = []
    for pack_weights in (True, False):
        model = LlamaDecoder.from_weights(config, weights, torch.bfloat16, "cpu", pack=pack_weights)
        assert model.packed == pack_weights
        spec = KVCacheSpec(config.num_layers, config.num_kv_heads, 16, config.head_dim, torch.bfloat16)
        runners.append(ModelRunner(model, KVCache.allocate(spec, num_blocks=8, budget_bytes=None, device="cpu")))
    assert runners[0].model.lm_head.layout == torch._mkldnn and runners[1].model.lm_head.layout == torch.strided
    prefill = ModelInput(prefills=[ScheduledChunk(0, [1, 2, 3, 4, 5], 0, [0])])
    decode = ModelInput(decodes=[ScheduledChunk(0, [6], 5, [0])])
    for step in (prefill, decode):
        assert torch.equal(runners[0].execute(step).logits, runners[1].execute(step).logits)
