"""Load a Llama-family model from a Hugging Face folder (config.json + *.safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from worker.model.model_config import ModelConfig

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


def load_safetensors(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every ``*.safetensors`` shard (HF tensor names).

    Raises:
        FileNotFoundError: no config.json or no safetensors file.
        ValueError: unsupported model type or RoPE scaling.
    """
    from safetensors.torch import load_file

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json")
    config = hf_config(json.loads(config_path.read_text()))
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{str(folder)!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(shard)))
    return config, weights


def _rope_theta(raw: dict) -> float:
    """RoPE base from transformers v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``.

    Raises:
        ValueError: a RoPE scaling type other than "default" (llama3, yarn, ... unsupported).
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type"))
    if kind not in (None, "default"):
        raise ValueError(f"rope_scaling {params!r} unsupported (only default RoPE)")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _context_length(raw: dict) -> int:
    """``max_position_embeddings`` (default 2048), capped at an active ``sliding_window``."""
    trained = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    if window and int(window) < trained:
        log.warning("sliding-window attention (%d tokens) is not implemented: the context length is capped "
                    "at %d tokens (the model was trained for %d)", int(window), int(window), trained)
        return int(window)
    return trained


def hf_config(raw: dict) -> ModelConfig:
    """:class:`ModelConfig` from a transformers ``config.json`` dict (v4 or v5 layout).

    Sliding-window attention (Mistral 7B v0.1's ``sliding_window: 4096``) is
    not implemented: the context length is capped at the window instead, where
    full attention and the window give the same outputs, as vLLM does with
    ``--disable-sliding-window``. A window the config turns off
    (``use_sliding_window: false``, Qwen2) or at least the trained context is ignored.

    Raises:
        ValueError: unsupported ``model_type`` or RoPE scaling.
    """
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} unsupported (supported: {sorted(SUPPORTED_MODEL_TYPES)})")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return ModelConfig(
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        rope_theta=_rope_theta(raw),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        context_length=_context_length(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
    )
