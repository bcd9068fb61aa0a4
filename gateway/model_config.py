"""Which models a gateway serves: one configuration, read once at start (issue 44).

A model is a name (the id clients send in ``model``, the first ``--served-model-name`` of its
workers, and the name in its request streams ``inflight:requests:{name}:{p}``) and the path
of the files its tokenizer and chat template come from (``common.model_files.resolve_model_path``:
None or "smollm2" = the default SmolLM2). They come from, in this order:

* ``--model NAME=PATH`` (``GatewaySettings.models``), repeated, or ``--model PATH`` (the name
  is then :func:`common.served_model.default_served_name` of the path);
* a models file (``--models-file``, JSON, or YAML where PyYAML is installed): a list, or
  ``{"models": [...]}``, of ``{"name": ..., "path": ..., "task": "generate" | "embed"}``; an
  entry without ``path`` is refused unless its name is the default model's
  (``SmolLM2-135M-Instruct``: no path = the default SmolLM2 files);
* neither: one model, ``served_model_name`` at ``model_path`` (today's single model).

The first model is the default one: a request without ``model`` gets it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.served_model import DEFAULT_SERVED_NAME, TASKS, default_served_name


@dataclass(frozen=True)
class ModelSpec:
    """One configured model.

    Attributes:
        name: the model's id (its workers' first ``--served-model-name``).
        path: its files for ``resolve_model_path`` (None: the default model).
        task: "generate" or "embed", what it serves while no worker says (a worker's
            announcement wins).
    """

    name: str
    path: str | None = None
    task: str = "generate"


def parse_model_arg(value: str) -> ModelSpec:
    """``NAME=PATH`` or ``PATH`` (named by :func:`default_served_name`).

    Raises:
        ValueError: an empty name or path.
    """
    name, sep, path = value.partition("=")
    if not sep:
        name, path = default_served_name(value), value
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"--model {value!r}: expected NAME=PATH or PATH")
    return ModelSpec(name, path)


def _from_entry(entry: Any, where: str) -> ModelSpec:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"].strip():
        raise ValueError(f"{where}: each model needs a 'name' string")
    task = entry.get("task", "generate")
    if task not in TASKS:
        raise ValueError(f"{where}: model {entry['name']!r}: task must be one of {', '.join(TASKS)}, got {task!r}")
    name, path = entry["name"].strip(), entry.get("path")
    if path is None and name != DEFAULT_SERVED_NAME:
        # no silent fallback to SmolLM2's tokenizer for another model: its prompts would be
        # tokenized, counted and templated wrongly
        raise ValueError(f"{where}: model {name!r} needs a 'path' (its tokenizer and chat template come from "
                         f"it; only {DEFAULT_SERVED_NAME!r} may omit it, meaning the default model)")
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ValueError(f"{where}: model {name!r}: 'path' must be a non-empty string, got {path!r}")
    return ModelSpec(name, path.strip() if path is not None else None, task)


def read_models_file(path: str) -> list[ModelSpec]:
    """The models of a JSON (or, with PyYAML, YAML) file.

    Raises:
        ValueError: unreadable, malformed, or an entry without a name, with an unknown task,
            or without a path (but for the default model's name).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"models file {path!r}: {exc}") from exc
    try:
        data = json.loads(text)
    except ValueError:
        try:
            import yaml  # optional: the gateway image has no PyYAML, JSON always works
        except ImportError as exc:
            raise ValueError(f"models file {path!r} is not JSON (YAML needs PyYAML)") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"models file {path!r}: {exc}") from exc
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"models file {path!r}: expected a non-empty list of models (or {{'models': [...]}})")
    return [_from_entry(e, f"models file {path!r}") for e in entries]


def model_specs(models: tuple[str, ...], models_file: str, served_model_name: str,
                model_path: str | None) -> list[ModelSpec]:
    """The gateway's models, the default one first (see the module docstring).

    Raises:
        ValueError: a malformed ``--model``, models file, or a name given twice.
    """
    specs = [parse_model_arg(m) for m in models]
    if models_file:
        specs += read_models_file(models_file)
    if not specs:
        specs = [ModelSpec(served_model_name, model_path)]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"model {spec.name!r} is configured twice")
        seen.add(spec.name)
    return specs
