"""Load a model from a Hugging Face folder (config.json + *.safetensors); the config is
read by :func:`worker.model.hf_config.hf_config`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.progress import Progress
from worker.model.hf_config import SUPPORTED_MODEL_TYPES, hf_config
from worker.model.model_config import ModelConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "hf_config", "load_safetensors"]


def load_safetensors(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config.json and every ``*.safetensors`` shard (HF tensor names).

    Raises:
        FileNotFoundError: no config.json or no safetensors file.
        ValueError: unsupported model type or RoPE scaling.
    """
    from safetensors import safe_open

    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json")
    config = hf_config(json.loads(config_path.read_text()))
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{str(folder)!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    total = sum(shard.stat().st_size for shard in shards)
    with Progress(f"loading {folder.name}", total=total, unit="B") as progress:
        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name)
                    progress.advance(weights[name].numel() * weights[name].element_size())
            progress.update(sum(s.stat().st_size for s in shards[:shards.index(shard) + 1]))  # + its header
    return config, causal_lm_names(weights)


def causal_lm_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` named as a causal LM's (``model.embed_tokens.weight``, ``model.layers.{i}.…``,
    ``model.norm.weight``, optional ``lm_head.weight``). A base model saved alone (transformers'
    ``Qwen3Model``/``LlamaModel``, as sentence-transformers embedding models such as
    Qwen3-Embedding ship: ``embed_tokens.weight``, ``layers.{i}.…``, ``norm.weight``, no head)
    gets the ``model.`` prefix; a causal LM's names are returned as they are."""
    if "model.embed_tokens.weight" in weights or "embed_tokens.weight" not in weights:
        return weights
    return {name if name.startswith("lm_head.") else f"model.{name}": t for name, t in weights.items()}
