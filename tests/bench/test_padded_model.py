"""bench.padded_model: the default SmolLM2 padded from width 576 to 768 (12 heads, 4 KV heads)
computes what the original computes, through the worker's own loader and forward pass."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")


def _runner(path):
    from bench.targets.engine import EngineTargetSettings, load

    return load(EngineTargetSettings(model=str(path), dtype="float32", kv_cache_mib=16, quantization="none"))


def test_the_padded_model_gives_the_original_logits(tmp_path):
    """Two blocks of SmolLM2 written F16 at width 576 and padded to 768: the worker's float32
    forward gives the same next-token argmax at every position and logits within float32's
    reordering of the sums."""
    from bench import padded_model
    from bench.quant_accuracy import all_logits

    plain = padded_model.make(tmp_path, [], layers=2, padded=False)[0]
    padded = padded_model.make(tmp_path, [], layers=2, padded=True)[0]
    (a_runner, tokenizer), (b_runner, _) = _runner(plain), _runner(padded)
    assert b_runner.model.config.hidden_size == 768 and b_runner.model.config.num_heads == 12
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    a, b = all_logits(a_runner, ids), all_logits(b_runner, ids)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max().item() < 1e-4 * a.abs().max().item()


def test_rmsnorm_of_the_padded_stream_equals_the_original():
    """The norm rule alone: weights times sqrt(c) and epsilon times c, c = 576 / 768."""
    from bench.padded_model import Source, pad_tensor

    src = Source(576, 9, 3, 64, 1e-5)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(576), rng.standard_normal(576)
    x_pad, w_pad = np.concatenate([x, np.zeros(192)]), pad_tensor("blk.0.attn_norm.weight", w, src)
    original = x / math.sqrt(np.mean(x * x) + src.eps) * w
    padded = x_pad / math.sqrt(np.mean(x_pad * x_pad) + src.eps * src.c) * w_pad
    assert np.allclose(padded[:576], original, rtol=1e-6) and not padded[576:].any()


def test_an_unknown_tensor_has_no_rule():
    from bench.padded_model import Source, pad_tensor

    with pytest.raises(KeyError, match="no padding rule"):
        pad_tensor("blk.0.attn_qkv.weight", np.zeros((4, 4)), Source(576, 9, 3, 64, 1e-5))
