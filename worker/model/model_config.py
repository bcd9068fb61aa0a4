"""Shape and numerics of a Llama-family decoder (Llama 2/3, SmolLM, Qwen2/2.5,
Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3 text)."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.model.rope import RopeConfig

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
        architecture: the model family's name (HF ``model_type``), for messages.
        rope: the rotary embedding with its scaling (None: default RoPE at ``rope_theta``).
        local_rope: the rotary embedding of sliding-window layers when it differs
            (Gemma 3's ``rope_local_base_freq``); None = :attr:`rope`.
        layer_windows: per layer, the sliding window in tokens (0 = full
            attention); empty = every layer full.
        qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3).
        norm_plus_one: Gemma's RMSNorm, ``x_hat * (1 + w)`` multiplied in float32.
        sandwich_norms: Gemma 2/3's norms after attention and around the MLP.
        embedding_scale: embeddings multiplied by it (Gemma: ``sqrt(hidden_size)``
            rounded to the compute dtype).
        hidden_act: the MLP's gate activation (:data:`SUPPORTED_ACTIVATIONS`).
        attn_logit_softcapping: tanh soft-cap of attention scores (Gemma 2).
        final_logit_softcapping: tanh soft-cap of the logits (Gemma 2).
        query_pre_attn_scalar: attention scale ``query_pre_attn_scalar ** -0.5``
            instead of ``head_dim ** -0.5`` (Gemma).
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
    architecture: str = "llama"
    rope: RopeConfig | None = None
    local_rope: RopeConfig | None = None
    layer_windows: tuple[int, ...] = field(default=())
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embedding_scale: float = 1.0
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"activation {self.hidden_act!r} unsupported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")

    @property
    def global_rope(self) -> RopeConfig:
        """The rotary embedding of full-attention layers."""
        return self.rope or RopeConfig(theta=self.rope_theta, max_position_embeddings=self.context_length)

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotary embedding of ``layer``: :attr:`local_rope` on sliding layers when set."""
        return self.local_rope if self.local_rope is not None and self.window(layer) else self.global_rope

    def window(self, layer: int) -> int:
        """Sliding window of ``layer`` in tokens, 0 = full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def llama_layout(self) -> bool:
        """True when the blocks are Llama's (pre-norms with Llama numerics, SwiGLU,
        no q/k norm, no embedding scale, no logit soft-cap): the fused CPU path
        runs them. RoPE scalings, windows and attention soft-caps do not matter."""
        return not (self.qk_norm or self.norm_plus_one or self.sandwich_norms or self.embedding_scale != 1.0
                    or self.hidden_act != "silu" or self.final_logit_softcapping)

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim
