""":class:`ModelConfig` from a transformers ``config.json`` (the published v4 layout
with ``rope_scaling``/``rope_theta``, or the v5 layout with ``rope_parameters``),
for the supported ``model_type`` values."""

from __future__ import annotations

from worker.model.model_config import SUPPORTED_ACTIVATIONS, ModelConfig
from worker.model.rope import RopeConfig, rope_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")


def hf_config(raw: dict) -> ModelConfig:
    """:class:`ModelConfig` from a transformers ``config.json`` dict.

    Per family: Qwen2 adds q/k/v biases; Qwen3 and Gemma 3 an RMSNorm on each q/k
    head; Gemma 2/3 their (1 + w) norms, sandwich norms, ``sqrt(hidden)``
    embedding scale, ``query_pre_attn_scalar``, tanh-GELU and soft-caps (Gemma 2),
    and alternating sliding-window layers (``layer_types``, else Gemma 2's
    every other layer, Gemma 3's ``sliding_window_pattern``); Gemma 3's
    sliding layers use ``rope_local_base_freq``. Mistral and Phi-3 slide on every
    layer, Qwen2/3 only with ``use_sliding_window`` from ``max_window_layers`` on.

    Raises:
        ValueError: an unsupported ``model_type``, RoPE type, activation, partial
            RoPE or MLP bias; each message names the value and the supported list.
    """
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} unsupported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if raw.get("mlp_bias"):
        raise ValueError(f"{model_type}: mlp_bias unsupported")
    if float(raw.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"{model_type}: partial_rotary_factor {raw['partial_rotary_factor']} unsupported (only 1.0)")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    layers = raw["num_hidden_layers"]
    gemma = model_type in _GEMMA
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{model_type}: activation {act!r} unsupported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    global_rope, local_rope = _ropes(raw, model_type)
    return ModelConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        rope_theta=global_rope.theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        context_length=_context_length(raw, global_rope),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        architecture=model_type,
        rope=global_rope,
        local_rope=local_rope,
        layer_windows=_layer_windows(raw, model_type, layers),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        norm_plus_one=gemma,
        sandwich_norms=gemma,
        embedding_scale=hidden**0.5 if gemma else 1.0,
        hidden_act=act,
        attn_logit_softcapping=raw.get("attn_logit_softcapping") if gemma else None,
        final_logit_softcapping=raw.get("final_logit_softcapping") if gemma else None,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if gemma else None,
    )


def _ropes(raw: dict, model_type: str) -> tuple[RopeConfig, RopeConfig | None]:
    """Global and (Gemma 3) local rotary embeddings, from v4 ``rope_theta`` +
    ``rope_scaling`` (+ ``rope_local_base_freq``) or v5 ``rope_parameters``
    (flat, or nested by layer type)."""
    max_pos = int(raw.get("max_position_embeddings", 2048))
    original = raw.get("original_max_position_embeddings")  # Phi-3 keeps it outside the scaling dict
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    default_theta = 1_000_000.0 if model_type == "gemma3_text" else 10000.0
    theta = float(raw.get("rope_theta") or default_theta)
    if "full_attention" in params or "sliding_attention" in params:  # v5, per layer type
        full = params.get("full_attention") or {}
        sliding = params.get("sliding_attention")
        local = rope_config(sliding, float(sliding.get("rope_theta", 10000.0)), max_pos) if sliding else None
        return rope_config(full, float(full.get("rope_theta", theta)), max_pos, original), local
    rope = rope_config(params, theta, max_pos, original)
    if model_type != "gemma3_text":
        return rope, None
    return rope, RopeConfig(theta=float(raw.get("rope_local_base_freq") or 10000.0), max_position_embeddings=max_pos)


def _context_length(raw: dict, rope: RopeConfig) -> int:
    """``max_position_embeddings``, times the factor for linear and dynamic
    scaling and for YaRN over its original context, as vLLM derives the model's
    length (llama3, longrope and Gemma 3 configs already state the extended length)."""
    trained = int(raw.get("max_position_embeddings", 2048))
    if raw.get("model_type") == "gemma3_text":  # its linear factor is already in max_position_embeddings (vLLM too)
        return trained
    if rope.rope_type in ("linear", "dynamic"):
        return int(trained * rope.factor)
    if rope.rope_type == "yarn":
        return max(trained, int(rope.original_context * (rope.factor or 1.0)))
    return trained


def _layer_windows(raw: dict, model_type: str, layers: int) -> tuple[int, ...]:
    """Per-layer sliding window (0 = full), empty when no layer slides."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    if not window:
        return ()
    kinds = raw.get("layer_types")
    if kinds is None:
        if model_type == "gemma2":
            kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif model_type == "gemma3_text":
            pattern = int(raw.get("sliding_window_pattern", 6))
            kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif model_type in ("qwen2", "qwen3"):
            first = int(raw.get("max_window_layers", layers))
            kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:
            kinds = ["sliding_attention"] * layers
    if len(kinds) != layers:
        raise ValueError(f"{model_type}: layer_types has {len(kinds)} entries for {layers} layers")
    windows = tuple(int(window) if kind == "sliding_attention" else 0 for kind in kinds)
    return windows if any(windows) else ()
