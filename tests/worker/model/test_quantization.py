"""--quantization q8_0: where it may run, and the decoder with Q8_0 projections
against the same decoder computing each projection with the oracle."""

from unittest import mock

import pytest
import torch

import worker.model.llama as llama
from kernels import reference
from kernels.cpu import ops as cpu_ops
from worker.runner_io import ModelInput, ScheduledChunk
from worker.model.quantization import Q4Weight, Q8Weight, compute_dtype
from worker.model.model_runner import tiny_random_runner


def test_compute_dtype():
    assert compute_dtype("none", "bfloat16", "cpu") is None
    assert compute_dtype("q8_0", "auto", "cpu") == torch.float32
    assert compute_dtype("q8_0", torch.float32, "cpu") == torch.float32
    with pytest.raises(ValueError, match="computes in float32"):
        compute_dtype("q8_0", "bfloat16", "cpu")
    with pytest.raises(ValueError, match="CPU only"):
        compute_dtype("q8_0", "auto", "cuda")
    with pytest.raises(ValueError, match="unknown quantization 'q4'"):
        compute_dtype("q4", "auto", "cpu")


def test_q8_weight_needs_whole_blocks_and_counts_its_bytes():
    with pytest.raises(ValueError, match="multiples of 32"):
        Q8Weight.quantize(torch.zeros(8, 40))
    weight = Q8Weight.quantize(torch.randn(13, 64))
    assert weight.shape == (13, 64)
    assert weight.nbytes == 2 * 2 * 288 + 4 * 2 * 2 * 8  # 2 tiles x 2 blocks (weights + compensations, scales)


def _oracle_linear(x, weight, bias=None):
    """What a Q8Weight or Q4Weight computes, through kernels.reference on the float weight it came from."""
    oracle = reference.q4_1_linear if isinstance(weight, Q4Weight) else reference.q8_0_linear
    out = oracle(x.float(), _FLOAT[id(weight)])
    return out if bias is None else out + bias


_FLOAT: dict[int, torch.Tensor] = {}


def _prefill_logits(runner, ids):
    chunk = ScheduledChunk(0, ids, 0, list(range(-(-len(ids) // runner.block_size))))
    return runner.execute(ModelInput(prefills=[chunk])).logits


@pytest.mark.parametrize("quantization, projection", [("q8_0", Q8Weight), ("q4_1", Q4Weight)])
@pytest.mark.parametrize("attention_bias", [False, True])
def test_quantized_decoder_matches_the_oracle_and_stays_near_float32(attention_bias, quantization, projection):
    assert cpu_ops.available()
    plain = tiny_random_runner(seed=3, attention_bias=attention_bias)
    runner = tiny_random_runner(seed=3, attention_bias=attention_bias, quantization=quantization)
    model = runner.model
    assert model.quantization == quantization and isinstance(model.lm_head, Q8Weight)
    assert all(isinstance(getattr(layer, name), projection) for layer in model.layers
               for name in ("qkv", "o", "gate_up", "down"))
    ids = list(range(5, 45))
    got = _prefill_logits(runner, ids)
    # The oracle: the same random float weights, each projection through reference.q8_0_linear.
    oracle = tiny_random_runner(seed=3, attention_bias=attention_bias)
    for q8_layer, layer in zip(model.layers, oracle.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            dense = getattr(layer, name)
            _FLOAT[id(getattr(q8_layer, name))] = dense.to_dense() if dense.layout == torch._mkldnn else dense
    lm_head = oracle.model.lm_head
    _FLOAT[id(model.lm_head)] = lm_head.to_dense() if lm_head.layout == torch._mkldnn else lm_head
    with mock.patch.object(llama, "linear", _oracle_linear):
        want = _prefill_logits(runner, ids)  # same runner, same Q8Weight objects, oracle arithmetic
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = _prefill_logits(plain, ids)
    # quantized, not a different model (4 bits: 16 levels per block of 32 random weights)
    assert (got - base).abs().max() < (0.05 if quantization == "q8_0" else 0.25) * base.abs().max()


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])
def test_quantized_decoder_refuses_other_dtypes(quantization):
    with pytest.raises(ValueError, match=f"{quantization} runs float32 on the CPU"):
        tiny_random_runner(seed=0, dtype=torch.bfloat16, quantization=quantization)
