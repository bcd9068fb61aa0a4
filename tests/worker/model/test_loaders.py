"""Safetensors folder loading (Llama and Qwen2 shapes), KV-cache sizing, dtype choice."""

from __future__ import annotations

import json

import pytest
import torch

from worker.runner_io import ModelInput, ScheduledChunk
from worker.model.kv_cache import KVCache, KVCacheSpec
from worker.model.dtype import cpu_has_bf16, resolve_dtype
from worker.model.gguf_loader import gguf_config
from worker.model.safetensors_loader import hf_config
from worker.model.model_runner import load_model_runner

transformers = pytest.importorskip("transformers")


def _save_tiny(folder, kind: str):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256, rope_theta=5000.0)
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **common))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "proj" in name and "self_attn" in name else 0.05)  # sharp attention: RoPE matters
    model.eval().save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_safetensors_folder_matches_transformers(tmp_path, kind):
    hf = _save_tiny(tmp_path, kind)
    runner = load_model_runner(tmp_path, dtype="float32", block_size=8, num_blocks=8)
    assert runner.config.attention_bias == (kind == "qwen2")
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 8, 41]
    out = runner.execute(ModelInput(prefills=[ScheduledChunk(0, ids, 0, [6, 2, 5])]))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(out.logits[0], expected, rtol=1e-4, atol=1e-4)


def test_hf_config_rejects_unknown_model_type_and_rope_type_naming_the_supported_ones():
    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=8, vocab_size=8)
    with pytest.raises(ValueError, match=r"model_type 'gpt2' unsupported \(supported: llama, mistral, qwen2"):
        hf_config({"model_type": "gpt2", **base})
    with pytest.raises(ValueError, match=r"RoPE type 'su' unsupported \(supported: default, linear, dynamic"):
        hf_config({"model_type": "llama", "rope_scaling": {"rope_type": "su", "factor": 2.0}, **base})
    with pytest.raises(ValueError, match="needs a factor"):
        hf_config({"model_type": "llama", "rope_scaling": {"rope_type": "llama3"}, **base})
    with pytest.raises(ValueError, match="activation 'relu' unsupported"):
        hf_config({"model_type": "gemma2", "hidden_activation": "relu", **base})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        hf_config({"model_type": "phi3", "partial_rotary_factor": 0.75, **base})


def test_hf_config_sliding_windows_per_layer():
    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=6, intermediate_size=8, vocab_size=8,
                max_position_embeddings=32768)
    mistral = hf_config({"model_type": "mistral", "sliding_window": 4096, **base})
    assert mistral.context_length == 32768 and mistral.layer_windows == (4096,) * 6
    assert hf_config({"model_type": "mistral", "sliding_window": None, **base}).layer_windows == ()
    assert hf_config({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False,
                      **base}).layer_windows == ()
    assert hf_config({"model_type": "gemma2", "sliding_window": 4096, **base}).layer_windows == (4096, 0) * 3
    gemma3 = hf_config({"model_type": "gemma3_text", "sliding_window": 512, "sliding_window_pattern": 3,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, **base})
    assert gemma3.layer_windows == (512, 512, 0) * 2 and gemma3.context_length == 32768
    assert gemma3.layer_rope(0).theta == 10000.0 and gemma3.layer_rope(0).rope_type == "default"
    assert gemma3.layer_rope(2).theta == 1_000_000.0 and gemma3.layer_rope(2).factor == 8.0


def test_gguf_config_sliding_window(tmp_path):
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.block_count": 2, "llama.feed_forward_length": 8, "llama.context_length": 32768}
    assert gguf_config(meta, tmp_path / "m.gguf").layer_windows == ()
    meta["llama.attention.sliding_window"] = 4096
    config = gguf_config(meta, tmp_path / "m.gguf")
    assert config.context_length == 32768 and config.layer_windows == (4096, 4096)


def test_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model_runner(tmp_path / "nope.gguf")


def test_kv_cache_sizing():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, block_size=16, head_dim=8, dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * 3 * 2 * 16 * 8 * 2
    cache = KVCache.allocate(spec, budget_bytes=10 * spec.bytes_per_block + 5)
    assert cache.num_blocks == 10 and cache.total_bytes == 10 * spec.bytes_per_block
    assert cache.layers[0][0].shape == (10, 2, 16, 8) and len(cache.layers) == 3
    with pytest.raises(ValueError, match="kv_cache_bytes=1 "):
        KVCache.allocate(spec, budget_bytes=1)
    with pytest.raises(ValueError, match="exactly one"):
        KVCache.allocate(spec, num_blocks=4, budget_bytes=4096)


def test_dtype_resolution(tmp_path):
    assert resolve_dtype("float32", "cpu", 64, 128) is torch.float32
    assert resolve_dtype("bf16", "cpu", 64, 128) is torch.bfloat16
    assert resolve_dtype("auto", "cpu", 64, 128) is (torch.bfloat16 if cpu_has_bf16() else torch.float32)
    with pytest.raises(ValueError, match="'half-ish'"):
        resolve_dtype("half-ish", "cpu", 64, 128)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n")
    assert cpu_has_bf16(info)
    info.write_text("flags\t\t: fpu sse avx2\n")
    assert not cpu_has_bf16(info)
    assert not cpu_has_bf16(tmp_path / "missing")


def test_tiny_config_json_round_trip(tmp_path):
    _save_tiny(tmp_path, "llama")
    cfg = hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta) == (4, 1, 16, 5000.0)
