"""GGUF files with the quantization types people download (Q4_K_M mixes Q4_K and
Q6_K, Q5_K_M Q5_K and Q6_K, plus Q8_0): a tiny Qwen2 written with gguf's own
writer, its tensors in those types, loads and computes what transformers computes
from the same dequantized weights; an I-quant and an unknown RoPE scaling are
refused at load with the supported list; llama.cpp's ``rope_freqs`` tensor (Llama
3.1's llama3 scaling) reaches the RoPE. gguf-py cannot quantize K types, so their
blocks are random bytes with small finite scales: any such block is a valid one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.model.gguf_loader import SUPPORTED_QUANT_TYPES
from worker.model.model_runner import load_model_runner
from worker.runner_io import ModelInput, ScheduledChunk

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 256, 4, 2, 256, 64, 2
HEAD_DIM = HIDDEN // HEADS
# offset of each K block's float16 scale(s) within the block (ggml-common.h block_q4_K, _q5_K, _q6_K)
_F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/worker/conftest.py


def _blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, bytes]`` of valid ``kind`` blocks for a ``[rows, cols]`` tensor."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "Q8_0":
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS[kind]:
        scale = (rng.uniform(0.5, 1.0, (rows, cols // block)) * 2e-3).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _write(path, kinds: list[str], *, extra=None) -> dict[str, torch.Tensor]:
    """Write a tiny qwen2 GGUF, projections quantized in turn with ``kinds``; return
    the HF-named float32 weights (the dequantized values) for transformers."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if extra:
        extra(writer)
    hf: dict[str, torch.Tensor] = {}
    turn = iter(range(10**6))

    def quantized(gguf_name: str, hf_name: str, rows: int, cols: int) -> None:
        kind = kinds[next(turn) % len(kinds)]
        raw = _blocks(kind, rows, cols, rng)
        writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        hf[hf_name] = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).copy())

    def plain(gguf_name: str, hf_name: str, values: np.ndarray) -> None:
        writer.add_tensor(gguf_name, values.astype(np.float32))
        hf[hf_name] = torch.from_numpy(values.astype(np.float32))

    quantized("token_embd.weight", "model.embed_tokens.weight", VOCAB, HIDDEN)
    quantized("output.weight", "lm_head.weight", VOCAB, HIDDEN)
    plain("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        blk, hf_blk = f"blk.{i}.", f"model.layers.{i}."
        for name, hf_name, rows in (("attn_q", "self_attn.q_proj", q), ("attn_k", "self_attn.k_proj", kv),
                                    ("attn_v", "self_attn.v_proj", kv)):
            quantized(blk + name + ".weight", hf_blk + hf_name + ".weight", rows, HIDDEN)
            plain(blk + name + ".bias", hf_blk + hf_name + ".bias", 0.1 * rng.standard_normal(rows))
        quantized(blk + "attn_output.weight", hf_blk + "self_attn.o_proj.weight", HIDDEN, q)
        quantized(blk + "ffn_gate.weight", hf_blk + "mlp.gate_proj.weight", INTER, HIDDEN)
        quantized(blk + "ffn_up.weight", hf_blk + "mlp.up_proj.weight", INTER, HIDDEN)
        quantized(blk + "ffn_down.weight", hf_blk + "mlp.down_proj.weight", HIDDEN, INTER)
        plain(blk + "attn_norm.weight", hf_blk + "input_layernorm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
        plain(blk + "ffn_norm.weight", hf_blk + "post_attention_layernorm.weight",
              1 + 0.1 * rng.standard_normal(HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _hf_logits(weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-6,
                                      rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("quantization", ["none", "auto"])
@pytest.mark.parametrize("kinds", [["Q4_K", "Q6_K"], ["Q5_K", "Q6_K"], ["Q8_0"]], ids=["Q4_K_M", "Q5_K_M", "Q8_0"])
def test_quantized_gguf_matches_transformers_on_the_dequantized_weights(tmp_path, kinds, quantization):
    """``none``: the loader's dequantized float32 weights; ``auto`` (the default, ``gguf`` on the
    CPU): the file's own blocks, whose K-quant products round the activations to int16 per 256
    values: random blocks make outliers that leave the other values of their 256 about 8 bits,
    up to 1e-3 of the largest logit here (teacher-forced on SmolLM2, a mean KL of 2e-6 nats)."""
    path = tmp_path / "tiny.gguf"
    weights = _write(path, kinds)
    ids = [5, 17, 3, 60, 22, 9, 41, 33, 8, 2, 50, 12]
    runner = load_model_runner(path, dtype="float32", kv_cache_dtype="float32", block_size=8, num_blocks=4,
                               quantization=quantization)
    prefill = runner.execute(ModelInput(prefills=[ScheduledChunk(0, ids[:-1], 0, [3, 1])])).logits[0]
    decode = runner.execute(ModelInput(decodes=[ScheduledChunk(0, ids[-1:], len(ids) - 1, [3, 1])])).logits[0]
    expected = _hf_logits(weights, ids)
    atol = 1e-4 if quantization == "none" else 2e-3 * expected.abs().max().item()
    torch.testing.assert_close(torch.stack([prefill, decode]), expected[-2:], rtol=1e-4, atol=atol)


def test_an_iquant_tensor_is_refused_at_load_naming_the_supported_types(tmp_path):
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    qtype = gguf.GGMLQuantizationType.IQ4_NL
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    writer.add_tensor("token_embd.weight", np.zeros((4, HIDDEN // block * size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"type IQ4_NL, unsupported \(supported: F32, .*Q4_K, Q5_K, Q6_K\)"):
        load_model_runner(path, dtype="float32", num_blocks=4)
    assert "IQ4_NL" not in SUPPORTED_QUANT_TYPES


def test_an_unknown_rope_scaling_is_refused_naming_the_supported_ones(tmp_path):
    path = tmp_path / "rope.gguf"
    _write(path, ["Q8_0"], extra=lambda w: w.add_string("qwen2.rope.scaling.type", "longrope2"))
    with pytest.raises(ValueError, match=r"RoPE scaling 'longrope2' unsupported \(supported: none, linear, yarn\)"):
        load_model_runner(path, dtype="float32", num_blocks=4)


def test_rope_freqs_tensor_divides_the_frequencies(tmp_path):
    """A Llama 3.1 GGUF's llama3 scaling: logits equal transformers' with the same
    divisors applied to its inverse frequencies."""
    path = tmp_path / "freqs.gguf"
    factors = np.linspace(1.0, 8.0, HEAD_DIM // 2).astype(np.float32)
    weights = _write(path, ["Q8_0"], extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    runner = load_model_runner(path, dtype="float32", kv_cache_dtype="float32", block_size=8, num_blocks=4)
    assert runner.config.rope.freq_factors == tuple(float(f) for f in factors)
    ids = [5, 17, 3, 60, 22, 9, 41, 33, 8, 2, 50, 12]
    logits = runner.execute(ModelInput(prefills=[ScheduledChunk(0, ids, 0, [3, 1])])).logits[0]
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=256, rms_norm_eps=1e-6,
                                      rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.load_state_dict(weights, strict=True)
    rotary = model.model.rotary_emb
    rotary.inv_freq.copy_(rotary.inv_freq / torch.from_numpy(factors))
    rotary.original_inv_freq = rotary.inv_freq.clone()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
