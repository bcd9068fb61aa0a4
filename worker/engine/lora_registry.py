"""Which LoRA adapters an engine serves, which are loaded in the runner, and which the
unfinished requests hold.

An adapter is *registered* by name with its path (``--lora-modules``, or at run time through
:meth:`LoraRegistry.add`: vLLM's ``/v1/load_lora_adapter``) and gets an id (> 0; 0 is the base
model, as vLLM's ``lora_int_id``). At most ``max_loras`` are *loaded* in the runner at once; a
request naming a registered adapter that is not loaded loads it again from its path, evicting
the least recently used loaded adapter that no unfinished request holds. When every loaded
adapter is held, the request waits (``NO_ROOM``: the worker leaves it in its queue).

Removing an adapter (:meth:`LoraRegistry.remove`) unregisters its name at once (new requests
naming it are refused); its weights stay loaded until the last request holding it finishes.

Called from the worker's asyncio thread (admission) and its engine thread (run-time load and
unload between steps), so the bookkeeping takes a lock; the runner's loads happen under it.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any


class LoraNoRoom(Exception):
    """Every loaded adapter is held by unfinished requests: the request must wait."""


@dataclass(frozen=True)
class LoraEntry:
    """A registered adapter.

    Attributes:
        lora_id: the runner's id (> 0).
        name: the served name.
        path: its PEFT directory.
        digest: the runner's digest of its files (:meth:`runner.add_lora`).
    """

    lora_id: int
    name: str
    path: str
    digest: str

    @property
    def salt(self) -> str:
        """Its identity in the prefix cache's block hashes (:func:`common.block_hash.adapter_salt`)."""
        return f"{self.name}@{self.digest}"


class LoraRegistry:
    """Registered adapters, the LRU of the loaded ones (at most ``max_loras``) and the holds.

    Args:
        runner: has ``add_lora(lora_id, name, path) -> digest`` (raises ValueError /
            FileNotFoundError for a refused adapter) and ``remove_lora(lora_id)``.
        max_loras: most adapters loaded at once (>= 1).
    """

    def __init__(self, runner: Any, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.runner = runner
        self.max_loras = max_loras
        self._by_name: dict[str, LoraEntry] = {}
        self._by_id: dict[int, LoraEntry] = {}      # every entry still loaded or held, removed ones too
        self._loaded: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._holds: Counter[int] = Counter()
        self._ids = itertools.count(1)
        self._lock = threading.RLock()

    def names(self) -> list[str]:
        """The registered adapters' names, in registration order."""
        with self._lock:
            return list(self._by_name)

    def salts(self) -> dict[str, str]:
        """Each registered adapter's identity in block hashes (:attr:`LoraEntry.salt`), by name."""
        with self._lock:
            return {name: entry.salt for name, entry in self._by_name.items()}

    def loaded_names(self) -> list[str]:
        """The names of the adapters loaded in the runner now (least recently used first)."""
        with self._lock:
            return [self._by_id[i].name for i in self._loaded]

    def path(self, name: str) -> str | None:
        """The registered path of ``name``, or None."""
        with self._lock:
            entry = self._by_name.get(name)
            return entry.path if entry else None

    def add(self, name: str, path: str) -> None:
        """Register ``name`` at ``path``, loading it to check it (the load refuses a bad adapter
        before anything changes). The same name and path again is a no-op; another path
        replaces the adapter (requests already holding the old one finish with it).

        Raises:
            ValueError / FileNotFoundError: the runner refused it (the message says why);
            LoraNoRoom: never (a new adapter that finds every slot held stays registered and
                unloaded, and is loaded when a request needs it).
        """
        if not name.strip():
            raise ValueError("a LoRA adapter needs a name")
        with self._lock:
            old = self._by_name.get(name)
            if old is not None and old.path == path:
                return
            lora_id = next(self._ids)
            digest = self.runner.add_lora(lora_id, name, path)  # raises for a refused adapter
            entry = LoraEntry(lora_id, name, path, digest)
            self._by_id[lora_id] = entry
            self._loaded[lora_id] = None
            if old is not None:
                self._unregister(old)
            self._by_name[name] = entry
            self._fit(keep=lora_id)

    def remove(self, name: str) -> bool:
        """Unregister ``name`` (False when unknown); its weights go once nothing holds it."""
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None:
                return False
            self._unregister(entry)
            return True

    def acquire(self, name: str) -> LoraEntry:
        """Hold ``name`` for one request (load it if needed, most recently used now).

        Raises:
            KeyError: ``name`` is not registered.
            LoraNoRoom: it is not loaded and every loaded adapter is held.
            ValueError / FileNotFoundError: reloading it from its path failed.
        """
        with self._lock:
            entry = self._by_name.get(name)
            if entry is None:
                raise KeyError(name)
            if entry.lora_id not in self._loaded:
                if len(self._loaded) >= self.max_loras and self._victim() is None:
                    raise LoraNoRoom(f"all {self.max_loras} loaded LoRA adapters (--max-loras) are in use")
                self.runner.add_lora(entry.lora_id, entry.name, entry.path)
                self._loaded[entry.lora_id] = None
                self._fit(keep=entry.lora_id)
            self._loaded.move_to_end(entry.lora_id)
            self._holds[entry.lora_id] += 1
            return entry

    def release(self, lora_id: int) -> None:
        """One hold of ``lora_id`` ends; a removed adapter's weights go with its last hold."""
        with self._lock:
            self._holds[lora_id] -= 1
            if self._holds[lora_id] > 0:
                return
            del self._holds[lora_id]
            entry = self._by_id.get(lora_id)
            if entry is not None and self._by_name.get(entry.name) is not entry:
                self._drop(lora_id)

    def held(self) -> dict[str, int]:
        """Requests holding each adapter now, by name (for tests and the log)."""
        with self._lock:
            return {self._by_id[i].name: n for i, n in self._holds.items()}

    def _unregister(self, entry: LoraEntry) -> None:
        if self._by_name.get(entry.name) is entry:
            del self._by_name[entry.name]
        if not self._holds.get(entry.lora_id):
            self._drop(entry.lora_id)

    def _drop(self, lora_id: int) -> None:
        if self._loaded.pop(lora_id, 0) is None:
            self.runner.remove_lora(lora_id)
        self._by_id.pop(lora_id, None)

    def _victim(self) -> int | None:
        """The least recently used loaded adapter no request holds, or None."""
        return next((i for i in self._loaded if not self._holds.get(i)), None)

    def _fit(self, keep: int) -> None:
        """Evict least recently used unheld adapters (never ``keep``) while more than
        ``max_loras`` are loaded; a registered one stays registered (reloaded on demand)."""
        while len(self._loaded) > self.max_loras:
            victim = next((i for i in self._loaded if i != keep and not self._holds.get(i)), None)
            if victim is None:
                if not self._holds.get(keep):  # all others held: ``keep`` waits unloaded
                    self._loaded.pop(keep)
                    self.runner.remove_lora(keep)
                return
            self._loaded.pop(victim)
            self.runner.remove_lora(victim)
            if self._by_name.get(self._by_id[victim].name) is not self._by_id[victim]:
                self._by_id.pop(victim, None)
