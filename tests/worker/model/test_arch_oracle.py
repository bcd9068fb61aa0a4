"""Oracle: each supported architecture, built in transformers from its published
``config.json`` (scaled down in width, depth and vocabulary, every structural
feature kept: RoPE scaling, windows, soft-caps, biases, q/k norms, tied or untied
heads) with random weights, saved as safetensors, loaded into our runner and run
through the paged KV cache, against transformers' own incremental ``generate``:

* float32: the logits of the prefill (in two chunks) and of every decode step
  within 1e-4, and the same 32 greedy tokens;
* bfloat16: the same steps fed the float32 tokens, each step's logits within 15%
  (relative L2; 5% on average) of transformers' float32 ones.

Sliding windows are smaller than the sequence (20 prompt + 32 generated tokens),
and the length-dependent scalings (dynamic, longrope) have their original context
inside it, so windows and the grown frequencies are exercised. huggingface.co is
not reachable here: the published values are written out below (as
``config.json`` holds them, the v4 layout), and the config transformers saves (v5
layout) must read the same."""

from __future__ import annotations

import json

import numpy as np

import pytest
import torch

from worker.model.hf_config import hf_config
from worker.model.model_runner import load_model_runner
from worker.runner_io import ModelInput, ScheduledChunk

transformers = pytest.importorskip("transformers")

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 8, 41]
NEW_TOKENS = 32
BLOCK = 8
SMALL = dict(vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# meta-llama/Llama-3.2-1B: llama3 RoPE scaling, tied embeddings, head_dim 64.
LLAMA_32 = dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, head_dim=32,
                hidden_act="silu", hidden_size=128, intermediate_size=256, max_position_embeddings=131072,
                mlp_bias=False, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
                rms_norm_eps=1e-05, rope_theta=500000.0, tie_word_embeddings=True,
                rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"})
# Qwen/Qwen2.5-0.5B-Instruct: q/k/v biases, GQA 7:1 (here 2:1), tied, no active window.
QWEN25 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", hidden_size=128,
              intermediate_size=256, max_position_embeddings=32768, max_window_layers=21, num_attention_heads=2,
              num_hidden_layers=2, num_key_value_heads=1, rms_norm_eps=1e-06, rope_theta=1000000.0,
              sliding_window=32768, tie_word_embeddings=True, use_sliding_window=False)
# Qwen/Qwen3-0.6B: q/k RMSNorm, head_dim (128) not hidden/heads (64), tied.
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, head_dim=32,
             hidden_act="silu", hidden_size=64, intermediate_size=192, max_position_embeddings=40960,
             max_window_layers=28, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
             rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000, sliding_window=None,
             tie_word_embeddings=True, use_sliding_window=False)
# Qwen3's model card: YaRN for long contexts (factor 4 over 32768; here over 24).
QWEN3_YARN = dict(QWEN3, max_position_embeddings=96,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24})
# mistralai/Mistral-7B-v0.1: sliding_window 4096 (here 12), untied, GQA 4:1.
MISTRAL = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu", hidden_size=128,
               intermediate_size=256, max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=2,
               num_key_value_heads=1, rms_norm_eps=1e-05, rope_theta=10000.0, sliding_window=12,
               tie_word_embeddings=False)
# microsoft/Phi-3.5-mini-instruct: fused qkv_proj and gate_up_proj, longrope with 48 short and long
# factors over an original 4096 of 131072 (here 16 factors, 16 of 512: the prompt is longer, so
# transformers runs the long factors throughout, as we do; worker/model/rope.py), no GQA; its
# window is 262144 (Phi-3-mini-4k's 2047): here 40, inside the test sequence.
PHI35 = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", attention_bias=False, hidden_act="silu",
             hidden_size=128, intermediate_size=256, max_position_embeddings=512, num_attention_heads=4,
             num_hidden_layers=2, num_key_value_heads=4, original_max_position_embeddings=16, rms_norm_eps=1e-05,
             rope_theta=10000.0, sliding_window=40, tie_word_embeddings=False,
             rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.02 * i for i in range(16)],
                           "long_factor": [1.0 + 1.9 * i for i in range(16)]})
# google/gemma-2-2b: alternating sliding (4096, here 12) and global layers, soft-caps 50 and 30
# (here 5 and 3: random weights give scores of a few units, where tanh(x / 50) is the identity),
# query_pre_attn_scalar (27B's 144 = hidden/heads differs from head_dim, as here), (1 + w) norms,
# sandwich norms, sqrt(hidden) embedding scale, gelu_pytorch_tanh, tied.
GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attention_bias=False,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0, head_dim=64,
              hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", hidden_size=96,
              intermediate_size=192, max_position_embeddings=8192, num_attention_heads=4, num_hidden_layers=4,
              num_key_value_heads=2, query_pre_attn_scalar=48, rms_norm_eps=1e-06, rope_theta=10000.0,
              sliding_window=12)
# google/gemma-3-1b-it text config, with the 4B's rope_scaling (linear 8, global layers only):
# sliding_window_pattern 6, rope_local_base_freq 10000 on the local layers, q/k norms, no soft-caps.
GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attention_bias=False,
              attn_logit_softcapping=None, final_logit_softcapping=None, head_dim=32,
              hidden_activation="gelu_pytorch_tanh", hidden_size=64, intermediate_size=128,
              max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=6, num_key_value_heads=1,
              query_pre_attn_scalar=32, rms_norm_eps=1e-06, rope_local_base_freq=10000,
              rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1000000, sliding_window=12,
              sliding_window_pattern=6)
# Llama with linear and dynamic NTK scaling (Llama 2-era long-context fine-tunes), the
# original context (32) inside the test sequence.
LLAMA_LINEAR = dict(LLAMA_32, max_position_embeddings=32, rope_theta=10000.0, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "linear", "factor": 4.0})
LLAMA_DYNAMIC = dict(LLAMA_LINEAR, rope_scaling={"rope_type": "dynamic", "factor": 4.0})

ARCHS = {"llama3.2": LLAMA_32, "qwen2.5": QWEN25, "qwen3": QWEN3, "qwen3-yarn": QWEN3_YARN, "mistral": MISTRAL,
         "phi3.5": PHI35, "gemma2": GEMMA2, "gemma3": GEMMA3, "llama-linear": LLAMA_LINEAR,
         "llama-dynamic": LLAMA_DYNAMIC}


def _randomize(model, gemma: bool) -> None:
    """Weights that make attention sharp (so positions and windows matter) and keep
    activations O(1): projections N(0, gain^2 / fan_in), norms 1 + N(0, 0.1) (Gemma's
    stored w: N(0, 0.1)), biases N(0, 0.1), embeddings N(0, 1)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(noise * 0.1 + (0.0 if gemma else 1.0))
            elif p.dim() == 1:
                p.copy_(noise * 0.1)
            elif "embed" in name:
                p.copy_(noise)
            else:
                gain = 2.0 if any(k in name for k in ("q_proj", "k_proj", "qkv_proj")) else 1.0
                p.copy_(noise * gain / p.shape[1] ** 0.5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/worker/conftest.py


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    """(name, folder, HF model float32, HF greedy tokens, HF step logits [33, vocab])."""
    name, published = request.param, {**ARCHS[request.param], **SMALL}
    folder = tmp_path_factory.mktemp(name)
    (folder / "config.json").write_text(json.dumps(published))
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, published["model_type"].startswith("gemma"))
    model.eval().save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(published))  # what the Hub's file says
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(PROMPT):].tolist()
    return name, folder, saved, tokens, torch.cat(out.logits).float()


def _run(folder, dtype: str, teacher: list[int] | None) -> tuple[list[int], torch.Tensor]:
    """Our runner: the prompt prefilled in two chunks (12 + 8 tokens), then 31 decode
    steps; each step's input is our own greedy token, or ``teacher``'s. Returns the
    greedy tokens and the step logits ``[32, vocab]`` float32."""
    runner = load_model_runner(folder, dtype=dtype, kv_cache_dtype=dtype, block_size=BLOCK, num_blocks=24)
    table = list(range(23, 23 - 8, -1))  # 8 blocks, not in order
    rows, tokens = [], []
    runner.execute(ModelInput(prefills=[ScheduledChunk(0, PROMPT[:12], 0, table, needs_logits=False)]))
    logits = runner.execute(ModelInput(prefills=[ScheduledChunk(0, PROMPT[12:], 12, table)])).logits[0]
    for step in range(NEW_TOKENS):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        if step + 1 == NEW_TOKENS:
            break
        fed = teacher[step] if teacher else tokens[-1]
        chunk = ScheduledChunk(0, [fed], len(PROMPT) + step, table)
        logits = runner.execute(ModelInput(decodes=[chunk])).logits[0]
    return tokens, torch.stack(rows)


def test_float32_matches_transformers_prefill_decode_and_greedy(arch):
    name, folder, _, hf_tokens, hf_logits = arch
    tokens, logits = _run(folder, "float32", None)
    assert tokens == hf_tokens, name
    torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=1e-4)


def test_bfloat16_stays_near_float32_transformers(arch):
    name, folder, _, hf_tokens, hf_logits = arch
    _, logits = _run(folder, "bfloat16", hf_tokens)
    err = (logits - hf_logits).norm(dim=-1) / hf_logits.norm(dim=-1)  # per step; measured 0.004-0.11
    assert float(err.max()) < 0.15 and float(err.mean()) < 0.05, (name, err)


def test_saved_v5_config_reads_as_the_published_one(arch):
    _, folder, saved, _, _ = arch
    published = json.loads((folder / "config.json").read_text())
    assert hf_config(saved) == hf_config(published)


GGUF_ARCHS = {"qwen3": "qwen3", "qwen3-yarn": "qwen3", "phi3.5": "phi3", "llama3.2": "llama"}


def _write_gguf(folder, published: dict, arch: str):
    """The saved weights as a float32 GGUF in llama.cpp's layout: its tensor names, q/k rows
    permuted for arch ``llama`` (convert_hf_to_gguf.py ``LlamaModel.permute``), Llama 3's
    scaling as ``rope_freqs`` divisors, LongRoPE's as ``rope_factors_*`` tensors, YaRN as metadata."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from worker.model.rope import _llama3, _base_inv_freq, rope_config

    weights = load_file(str(folder / "model.safetensors"))
    heads, kv_heads = published["num_attention_heads"], published["num_key_value_heads"]
    head_dim = published.get("head_dim") or published["hidden_size"] // heads
    path = folder / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(published["num_hidden_layers"])
    writer.add_context_length(published["max_position_embeddings"])
    writer.add_embedding_length(published["hidden_size"])
    writer.add_feed_forward_length(published["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(published["rms_norm_eps"])
    writer.add_rope_freq_base(float(published["rope_theta"]))
    scaling = published.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if published.get("sliding_window") and arch == "phi3":
        writer.add_sliding_window(published["sliding_window"])
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if kind == "longrope":
        writer.add_rope_scaling_orig_ctx_len(published["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    if kind == "llama3":
        rope = rope_config(scaling, published["rope_theta"], published["max_position_embeddings"])
        base = _base_inv_freq(rope.theta, head_dim)
        writer.add_tensor("rope_freqs.weight", (base / _llama3(base, rope)).numpy().astype(np.float32))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, tensor in weights.items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{suffix}"
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = heads if ".q_proj." in name else kv_heads
            tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(
                tensor.shape)
        writer.add_tensor(out, tensor.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_the_same_weights_matches_transformers(arch):
    """The llama.cpp layout of the same model (GGUF arch names, permuted q/k for
    ``llama``, RoPE scalings as llama.cpp stores them) gives transformers' logits too."""
    name, folder, _, hf_tokens, hf_logits = arch
    if name not in GGUF_ARCHS:
        pytest.skip(f"{name}: no GGUF architecture read for it")
    published = json.loads((folder / "config.json").read_text())
    path = _write_gguf(folder, published, GGUF_ARCHS[name])
    tokens, logits = _run(path, "float32", None)
    assert tokens == hf_tokens, name
    torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=1e-4)
