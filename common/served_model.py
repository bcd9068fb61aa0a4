"""What a worker serves, as it announces it in its heartbeat ``inflight:workers:{id}`` (a JSON
object, common/redis_keys.py), and the names models are served under (issue 44).

A worker serves one model under one or more names (vLLM's ``--served-model-name``: the first
is the model's id, which names its request streams; the others are aliases), with a context
length (``max_model_len``), a tokenizer (its :func:`common.tokenizer_fingerprint.tokenizer_fingerprint`),
a task (``generate``; ``embed`` for a worker started with ``--runner pooling``) and the LoRA
adapters it has loaded (served by name, queued on the base model's streams). The gateway's
model registry (gateway/model_registry.py) and the fleet view (common/fleet.py) read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.model_files import DEFAULT_MODEL_ALIASES

#: The served name of the default model (SmolLM2-135M-Instruct, common/model_files.py), on
#: the worker and the gateway alike.
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
#: Tasks a worker may announce: ``generate`` (completions, chat) and ``embed`` (embeddings).
TASKS = ("generate", "embed")


def default_served_name(spec: str | None) -> str:
    """The name a model is served under when ``--served-model-name`` is not given: the
    default model's :data:`DEFAULT_SERVED_NAME`, else the file's name without ``.gguf`` or
    the folder's name (vLLM uses the ``--model`` argument itself)."""
    if spec is None or spec.strip().lower() in DEFAULT_MODEL_ALIASES:
        return DEFAULT_SERVED_NAME
    path = Path(spec.rstrip("/"))
    return path.name.removesuffix(".gguf")


def runner_task(runner: str | None) -> str:
    """The task a worker's ``--runner`` gives it: ``pooling`` → ``embed``, anything else
    (``generate``, ``auto``, None) → ``generate``."""
    return "embed" if runner == "pooling" else "generate"


@dataclass(frozen=True)
class Announcement:
    """One worker's heartbeat: what it serves.

    Attributes:
        worker_id: the worker's id (from the key, not the JSON).
        served_model_names: its names, the model's id first, then aliases.
        max_model_len: its context length in tokens (0: not announced).
        tokenizer_fingerprint: its tokenizer's fingerprint ("" : not announced, an older
            worker or a test double).
        task: "generate" or "embed".
        adapters: names of the LoRA adapters it has loaded.
        batching, started, metrics_url: what the fleet view shows (started: Unix seconds).
    """

    worker_id: str
    served_model_names: tuple[str, ...]
    max_model_len: int = 0
    tokenizer_fingerprint: str = ""
    task: str = "generate"
    adapters: tuple[str, ...] = ()
    batching: str = ""
    started: float = 0.0
    metrics_url: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def model(self) -> str:
        """The model's id: the first served name ("" when none was announced)."""
        return self.served_model_names[0] if self.served_model_names else ""

    def to_json(self) -> str:
        """The heartbeat's value. ``model`` is kept beside ``served_model_names`` for readers
        of the older shape."""
        return json.dumps({"model": self.model, "served_model_names": list(self.served_model_names),
                           "max_model_len": self.max_model_len,
                           "tokenizer_fingerprint": self.tokenizer_fingerprint, "task": self.task,
                           "adapters": list(self.adapters), "batching": self.batching,
                           "started": self.started, "metrics_url": self.metrics_url, **self.extra})

    @classmethod
    def parse(cls, worker_id: str, raw: str | bytes | None) -> "Announcement | None":
        """The announcement in a heartbeat's value; None for a value that is not a JSON
        object. An older heartbeat with ``model`` only serves that one name."""
        try:
            beat = json.loads(raw) if raw is not None else None
        except (TypeError, ValueError):
            return None
        if not isinstance(beat, dict):
            return None
        names = beat.get("served_model_names") or ([beat["model"]] if beat.get("model") else [])
        known = {"model", "served_model_names", "max_model_len", "tokenizer_fingerprint", "task", "adapters",
                 "batching", "started", "metrics_url"}
        try:
            return cls(worker_id=worker_id, served_model_names=tuple(str(n) for n in names),
                       max_model_len=int(beat.get("max_model_len") or 0),
                       tokenizer_fingerprint=str(beat.get("tokenizer_fingerprint") or ""),
                       task=str(beat.get("task") or "generate"),
                       adapters=tuple(str(a) for a in beat.get("adapters") or ()),
                       batching=str(beat.get("batching") or ""), started=float(beat.get("started") or 0.0),
                       metrics_url=str(beat.get("metrics_url") or ""),
                       extra={k: v for k, v in beat.items() if k not in known})
        except (TypeError, ValueError):
            return None
