"""A Llama GGUF in K-quant blocks (Q4_K_M's mix of Q4_K and Q6_K, a tied Q6_K embedding, as
llama.cpp's ``llama-quantize`` writes Llama 3.2 1B) runs on its own blocks under
``--quantization gguf`` (the default on the CPU): the projections, the lm_head and the
embedding stay views of the file's memory map, and the logits equal those of the same file
dequantized to float32 (``--quantization none``) within the int16 activations' rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import inflight_kernels
from tests.inflight_kernels.test_kquant_gemm import random_blocks
from worker.model.kquant import KQuantWeight
from worker.model.model_runner import load_model_runner
from worker.model.quantization import resolve_quantization
from worker.runner_io import ModelInput, ScheduledChunk

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not inflight_kernels.cpu_kernels_available(), reason="CPU kernels not built")

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 256, 4, 2, 512, 96, 2


def write_llama(path, kinds: list[str]) -> None:
    """A tiny Llama GGUF, tied embeddings in Q6_K, the projections in ``kinds`` in turn."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    turn = iter(range(10**6))

    def quantized(name: str, rows: int, cols: int, kind: str | None = None) -> None:
        kind = kind or kinds[next(turn) % len(kinds)]
        raw = random_blocks(kind, rows, cols, seed=next(turn)).numpy()
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])

    quantized("token_embd.weight", VOCAB, HIDDEN, "Q6_K")
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        quantized(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        quantized(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        quantized(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        quantized(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        quantized(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        quantized(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        quantized(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def logits(runner, ids: list[int]) -> torch.Tensor:
    prefill = runner.execute(ModelInput(prefills=[ScheduledChunk(0, ids[:-1], 0, [3, 1])])).logits[0]
    decode = runner.execute(ModelInput(decodes=[ScheduledChunk(0, ids[-1:], len(ids) - 1, [3, 1])])).logits[0]
    return torch.stack([prefill, decode])


@pytest.mark.parametrize("kinds", [["Q4_K", "Q6_K"], ["Q5_K", "Q6_K"], ["Q3_K", "Q2_K"]],
                         ids=["Q4_K_M", "Q5_K_M", "Q2_K-Q3_K"])
def test_kquant_blocks_compute_the_dequantized_model(tmp_path, kinds):
    path = tmp_path / "llama.gguf"
    write_llama(path, kinds)
    assert resolve_quantization("auto", path, "auto", "cpu") == "gguf"
    kw = dict(dtype="float32", kv_cache_dtype="float32", block_size=8, num_blocks=4)
    blocks = load_model_runner(path, quantization="auto", **kw)
    dense = load_model_runner(path, quantization="none", **kw)
    model = blocks.model
    assert isinstance(model.embed, KQuantWeight) and model.lm_head is model.embed
    layer = model.layers[0]
    assert all(isinstance(p, KQuantWeight) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    # v, o, gate/up and down are views of the file's bytes; q and k were copied in HF row order
    assert all(not part.blocks.untyped_storage().resizable() for part in layer.gate_up.parts)
    ids = [5, 17, 3, 60, 22, 9, 41, 33, 8, 2, 90, 12]
    got, expected = logits(blocks, ids), logits(dense, ids)
    scale = expected.abs().max()
    assert ((got - expected).abs().max() / scale).item() < 1e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_decode_stack_runs_kquant_layers_bit_for_bit_as_the_python_path(tmp_path):
    """The one-call C++ layer loop (decode_stack.cpp) takes K-quant projections, fused parts of
    mixed types included, and computes what the Python fused path computes, bit for bit."""
    path = tmp_path / "llama.gguf"
    write_llama(path, ["Q4_K", "Q6_K"])
    kw = dict(dtype="float32", kv_cache_dtype="float32", block_size=8, num_blocks=4)
    ids = [5, 17, 3, 60, 22, 9, 41, 33, 8, 2, 90, 12]
    stacked, python = load_model_runner(path, **kw), load_model_runner(path, **kw)
    python.model.use_decode_stack = False
    got = logits(stacked, ids)
    assert stacked.model._stack is not None and stacked.model._stack[1] is not None  # the stack ran
    assert torch.equal(got, logits(python, ids))


def tiles_runners(tmp_path):
    """A Q4_K_M-style file's runners: dense products from 4 rows (the decode stack, and the Python
    path), the int16 products alone, and the file dequantized to float32."""
    path = tmp_path / "llama.gguf"
    write_llama(path, ["Q4_K", "Q6_K"])
    kw = dict(kv_cache_dtype="float32", block_size=8, num_blocks=4)
    tiles = load_model_runner(path, dtype="auto", dense_min_rows=4, **kw)
    python = load_model_runner(path, dtype="auto", dense_min_rows=4, **kw)
    python.model.use_decode_stack = False
    int16 = load_model_runner(path, dtype="auto", dense_min_rows=0, **kw)
    dense = load_model_runner(path, dtype="float32", quantization="none", **kw)
    return tiles, python, int16, dense


@pytest.mark.skipif(not inflight_kernels.cpu_kquant_bf16(), reason="no bfloat16 tiles in this build (AVX-512 BF16)")
def test_steps_of_dense_min_rows_take_the_bfloat16_tiles(tmp_path):
    """``--dense-weights-min-rows`` reaches the K-quant projections and the tied lm_head without
    copying anything: an 11-token prefill (at least 4 rows) multiplies bfloat16 tiles made from the
    file's blocks, in the decode stack and on the Python path alike, and its logits stay within
    bfloat16's rounding of the dequantized model's, with the same argmax."""
    tiles, python, int16, dense = tiles_runners(tmp_path)
    model = tiles.model
    assert model.dense_min_rows == 4 and model.lm_head is model.embed and model.lm_head.dense_min_rows == 4
    assert all(p.dense_min_rows == 4 for p in (model.layers[0].qkv, model.layers[1].down))
    assert all(not part.blocks.untyped_storage().resizable() for part in model.layers[0].gate_up.parts)  # still the map
    ids = [5, 17, 3, 60, 22, 9, 41, 33, 8, 2, 90, 12]
    got, expected, on_int16 = logits(tiles, ids), logits(dense, ids), logits(int16, ids)
    assert torch.equal(got, logits(python, ids))
    scale = expected.abs().max()
    assert 1e-5 < ((got[0] - on_int16[0]).abs().max() / scale).item()  # the prefill took the tiles
    assert torch.equal(got[1], on_int16[1]) or ((got[1] - on_int16[1]).abs().max() / scale).item() < 3e-2
    assert ((got - expected).abs().max() / scale).item() < 3e-2
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.skipif(not inflight_kernels.cpu_kquant_f32(), reason="no float32 K-quant tiles in this build (AVX2 + FMA, "
                                                                  "no AVX-512)")
def test_steps_of_dense_min_rows_take_the_float32_tiles(tmp_path):
    """On an AVX2 CPU ``--dense-weights-min-rows`` (and ``auto``: no weight is copied) sends the
    K-quant products of an 11-token prefill to float32 dequantized per product, in the decode
    stack and on the Python path alike: the activations are not rounded, so its logits are the
    dequantized model's to float32's rounding, closer than the int16 products'."""
    tiles, python, int16, dense = tiles_runners(tmp_path)
    auto = load_model_runner(tmp_path / "llama.gguf", dtype="auto", dense_min_rows=None, kv_cache_dtype="float32",
                             block_size=8, num_blocks=4)
    assert auto.model.dense_min_rows > 4 and auto.model.lm_head.dense_min_rows == auto.model.dense_min_rows
    model = tiles.model
    assert model.dense_min_rows == 4 and model.lm_head is model.embed and model.lm_head.dense_min_rows == 4
    assert all(not part.blocks.untyped_storage().resizable() for part in model.layers[0].gate_up.parts)  # still the map
    ids = [5, 17, 3, 60, 22, 9, 41, 33, 8, 2, 90, 12]
    got, expected, on_int16 = logits(tiles, ids), logits(dense, ids), logits(int16, ids)
    assert torch.equal(got, logits(python, ids))
    scale = expected.abs().max()
    tiles_error = ((got[0] - expected[0]).abs().max() / scale).item()
    int16_error = ((on_int16[0] - expected[0]).abs().max() / scale).item()
    # the prefill took the tiles: 3.9e-5 against 1.7e-4 (the dense model sums in another order)
    assert tiles_error < 1e-4 and tiles_error < int16_error / 2
    assert ((got[1] - expected[1]).abs().max() / scale).item() < 1e-3  # one row: the int16 products
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
