"""The small Redis channel through which the gateway's admin endpoints load and unload LoRA
adapters on the workers of a model (vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``); the gateway writes, the workers reconcile. No torch here: the
gateway imports it.

Keys:

* ``inflight:lora:{model}``: a hash, adapter name → the latest operation on it as JSON
  (:class:`LoraOp`: ``{"op": id, "path": ...}`` to load, ``{"op": id, "unload": true}`` to
  unload). It is the model's desired adapters: a worker applies every operation it has not
  applied yet on each tick (worker/serve/lora_sync.py, every heartbeat period), so a worker
  started later loads the adapters added at run time too.
* ``inflight:lora:result:{op}``: a hash, worker id → the outcome of operation ``op`` on that
  worker as JSON (``{"ok": true}`` or ``{"error": why, "status": 400 | 404}``), kept
  :data:`RESULT_TTL_S` seconds; the gateway waits for the first report and answers with it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

#: Seconds a worker's report of one operation is kept.
RESULT_TTL_S = 300


def desired_key(model: str) -> str:
    """The hash of ``model``'s adapter operations."""
    return f"inflight:lora:{model}"


def result_key(op: str) -> str:
    """The hash of the workers' reports of operation ``op``."""
    return f"inflight:lora:result:{op}"


@dataclass(frozen=True)
class LoraOp:
    """The latest operation on one adapter of a model.

    Attributes:
        name: the adapter's served name.
        op: a unique id (the result hash's key).
        path: its PEFT directory, as the workers see it (a load).
        unload: True to unload it instead.
    """

    name: str
    op: str
    path: str = ""
    unload: bool = False

    @classmethod
    def load(cls, name: str, path: str) -> LoraOp:
        """A new load of ``name`` from ``path``."""
        return cls(name, uuid.uuid4().hex, path=path)

    @classmethod
    def remove(cls, name: str) -> LoraOp:
        """A new unload of ``name``."""
        return cls(name, uuid.uuid4().hex, unload=True)

    def to_json(self) -> str:
        """The hash field's value."""
        return json.dumps({"op": self.op, "unload": True} if self.unload else {"op": self.op, "path": self.path})

    @classmethod
    def from_json(cls, name: str | bytes, raw: str | bytes) -> LoraOp | None:
        """The operation stored for ``name``; None for a value that is not one (skipped)."""
        name = name.decode() if isinstance(name, bytes) else name
        try:
            data = json.loads(raw)
        except (ValueError, TypeError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("op"), str):
            return None
        if data.get("unload"):
            return cls(name, data["op"], unload=True)
        path = data.get("path")
        return cls(name, data["op"], path=path) if isinstance(path, str) and path else None


def outcome(error: str | None = None, status: int = 400) -> str:
    """A worker's report: ``{"ok": true}``, or the error (``status``: the HTTP status the
    gateway answers with, 400 for a refused adapter, 404 for an unknown one)."""
    return json.dumps({"ok": True} if error is None else {"error": error, "status": status})
