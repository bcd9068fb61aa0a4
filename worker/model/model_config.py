"""Shape and numerics of a Llama-family decoder (Llama, SmolLM, Qwen2, Mistral)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    Attributes:
        hidden_size: residual width (d_model).
        num_layers: decoder blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA when < num_heads).
        head_dim: per-head width.
        intermediate_size: SwiGLU inner width.
        vocab_size: embedding rows / logits width.
        rope_theta: RoPE base frequency (Su et al. 2021, "RoFormer").
        rms_norm_eps: RMSNorm epsilon (Zhang & Sennrich 2019).
        context_length: maximum positions the model was trained for.
        tie_word_embeddings: lm_head shares the embedding matrix.
        attention_bias: q/k/v projections have biases (Qwen2).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    context_length: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim
