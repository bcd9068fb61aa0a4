"""Pick the weight loader for a model path (GGUF file or HF safetensors folder), and
check a model's architecture, tensor types and RoPE without loading its weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.model.model_config import ModelConfig


def load_weights(path: str | Path, keep_kquants: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named weights of the model at ``path``; ``keep_kquants``: a GGUF file's
    K-quant tensors stay in their blocks (:func:`worker.model.gguf_loader.load_gguf`).

    Raises:
        FileNotFoundError: nothing usable at ``path``.
        ValueError: unsupported architecture or format.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from worker.model.gguf_loader import load_gguf

        return load_gguf(path, keep_kquants)
    if path.is_dir():
        from worker.model.safetensors_loader import load_safetensors

        return load_safetensors(path)
    raise FileNotFoundError(f"no .gguf file or model folder at {str(path)!r}")


def check_model(path: str | Path) -> ModelConfig:
    """The model's :class:`ModelConfig`, read from ``config.json`` or the GGUF header
    (and, for GGUF, every tensor's type), without reading any weights: the one-line
    refusal of an unsupported architecture, quantization or RoPE type at startup.

    Raises:
        FileNotFoundError: nothing usable at ``path``.
        ValueError: unsupported architecture, tensor type or RoPE type; the message
            names it and the supported list; a truncated or corrupt GGUF file, or one whose
            tensors disagree with its header (:func:`worker.model.gguf_check.check_gguf_file`).
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from worker.model.gguf_check import check_gguf_file
        from worker.model.gguf_loader import check_tensor_types, gguf_config, gguf_reader

        check_gguf_file(path)  # a truncated or corrupt file, or tensors unlike the header, before the map
        reader = gguf_reader(path)
        check_tensor_types(reader.tensors, path)
        meta = {name: field.contents() for name, field in reader.fields.items()
                if not name.startswith(("GGUF.", "tokenizer.ggml."))}
        return gguf_config(meta, path)
    if path.is_dir():
        from worker.model.hf_config import hf_config

        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{str(path)!r} has no config.json")
        return hf_config(json.loads(config_path.read_text()))
    raise FileNotFoundError(f"no .gguf file or model folder at {str(path)!r}")
