"""The tiny random-weight Llama as a whole Hugging Face folder: :mod:`common.tiny_model`'s
tokenizer and config files plus seeded random float32 weights (``model.safetensors``, HF
Llama tensor names, :func:`worker.model.random_weights.random_llama_weights`). Written with
torch and safetensors only (no transformers), so the worker image can make it at build time;
transformers loads the folder as a ``LlamaForCausalLM``.

    python -m worker.model.tiny_model FOLDER     # compose's worker-tiny image does this
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from common.tiny_model import CONTEXT, write_tiny_model_files
from worker.model.hf_config import hf_config
from worker.model.random_weights import random_llama_weights

__all__ = ["SEED", "write_tiny_model"]

#: The weights' seed: the same folder, byte for byte, wherever it is written.
SEED = 44


def write_tiny_model(folder: Path, context: int = CONTEXT) -> Path:
    """Write the tiny Llama's files into ``folder`` (made if missing).

    Args:
        folder: the model folder.
        context: the context length in tokens.

    Returns:
        ``folder``, holding ``config.json``, ``model.safetensors`` (float32),
        ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    config = write_tiny_model_files(folder, context)
    weights = random_llama_weights(hf_config(config), seed=SEED)
    path = folder / "model.safetensors"
    save_file({name: t.contiguous() for name, t in weights.items()}, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors writes 0600; an image's other user (the worker's) reads it
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m worker.model.tiny_model FOLDER [--context N]``."""
    parser = argparse.ArgumentParser(description="Write the tiny random Llama (weights, tokenizer, config).")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--context", type=int, default=CONTEXT)
    args = parser.parse_args(argv)
    write_tiny_model(args.folder, args.context)


if __name__ == "__main__":
    main()
