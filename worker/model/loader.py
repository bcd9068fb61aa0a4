"""Pick the weight loader for a model path (GGUF file or HF safetensors folder)."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.model.model_config import ModelConfig


def load_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named weights of the model at ``path``.

    Raises:
        FileNotFoundError: nothing usable at ``path``.
        ValueError: unsupported architecture or format.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from worker.model.gguf_loader import load_gguf

        return load_gguf(path)
    if path.is_dir():
        from worker.model.safetensors_loader import load_safetensors

        return load_safetensors(path)
    raise FileNotFoundError(f"no .gguf file or model folder at {str(path)!r}")
