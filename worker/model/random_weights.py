"""Random HF-named Llama weights for tests and the tiny test runner."""

from __future__ import annotations

import torch

from worker.model.model_config import ModelConfig


def random_llama_weights(config: ModelConfig, seed: int = 0, std: float = 0.05,
                         qk_std: float = 0.3) -> dict[str, torch.Tensor]:
    """float32 weights with HF Llama names: projections ~ N(0, std^2) except
    q/k ~ N(0, qk_std^2) (sharp attention, so position or cache errors show in
    the logits), norms ~ 1 + N(0, 0.1^2), biases ~ N(0, std^2); deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale + mean

    c, h = config, config.hidden_size
    weights = {"model.embed_tokens.weight": normal(c.vocab_size, h, scale=1.0),
               "model.norm.weight": normal(h, mean=1.0, scale=0.1)}
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = normal(c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": normal(h, mean=1.0, scale=0.1),
            p + "post_attention_layernorm.weight": normal(h, mean=1.0, scale=0.1),
            p + "self_attn.q_proj.weight": normal(c.q_size, h, scale=qk_std),
            p + "self_attn.k_proj.weight": normal(c.kv_size, h, scale=qk_std),
            p + "self_attn.v_proj.weight": normal(c.kv_size, h),
            p + "self_attn.o_proj.weight": normal(h, c.q_size),
            p + "mlp.gate_proj.weight": normal(c.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(c.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, c.intermediate_size),
        })
        if c.attention_bias:
            for name, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                weights[p + f"self_attn.{name}_proj.bias"] = normal(size)
    return weights
