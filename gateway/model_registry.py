"""The gateway's models: the tokenizer and chat template of each configured model, what the
workers announce they serve, and which model a request's ``model`` names (issue 44).

Each configured model (gateway/model_config.py) has its tokenizer loaded once, with its
fingerprint (common/tokenizer_fingerprint.py). Each ready worker announces in its heartbeat
(common/served_model.py) its served names (model id first, then aliases), context length,
tokenizer fingerprint, task and loaded LoRA adapters; the registry reads every heartbeat at
most once a second (SCAN + pipelined GETs, what the gateway's Redis user may do).

A worker is **refused** (logged at ERROR once, never routed to, shown in ``/fleet``) when
its model is not configured here (this gateway has no tokenizer for it) or when its
tokenizer's fingerprint differs from the one this gateway holds for that model. While a
model has a refused worker of the second kind, requests for that model are refused too
(503 ``tokenizer_mismatch``): that worker reads the model's shared stream, so a request
queued now could be served by a tokenizer that does not match the caps, prompt ids and
grammar the gateway checked.

:meth:`ModelRegistry.resolve_model` turns a request's ``model`` into a :class:`ResolvedModel`:
a configured model's id, an alias a ready worker of a configured model announces, or an
adapter one announces (queued on its base model's streams with ``lora_name``), one thing per
name (:meth:`ModelRegistry._names`: a later worker's clashing alias or adapter is ignored and
logged); anything else raises :class:`ModelNotFoundError` (404 ``model_not_found``) before anything is
reserved or queued.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import redis
import redis.asyncio

from common.redis_keys import HEARTBEAT_PREFIX, stream_name
from common.served_model import Announcement
from common.tokenizer_fingerprint import tokenizer_fingerprint
from gateway.errors import InvalidRequestError, ModelNotFoundError, UnavailableError
from gateway.model_config import ModelSpec

__all__ = ["ModelEntry", "ModelNotFound", "ModelNotFoundError", "ModelRegistry", "ResolvedModel", "ServedModel"]

#: The name other modules may use for the 404 ``model_not_found`` (gateway/errors.py's class).
ModelNotFound = ModelNotFoundError

log = logging.getLogger(__name__)

#: Seconds the workers' announcements are reused before the heartbeats are read again.
ANNOUNCEMENTS_TTL_S = 1.0
#: A name found nowhere is looked for again in heartbeats at most this old (seconds): an adapter
#: loaded a moment ago is found, and a flood of unknown names costs at most 4 reads a second.
UNKNOWN_NAME_TTL_S = 0.25


@dataclass(frozen=True)
class ServedModel:
    """A configured model and its tokenizer.

    Attributes:
        spec: its configuration (name, path, task).
        tokenizer: its :class:`common.tokenizer.Tokenizer` (or a test double): prompt ids,
            chat template, context length.
        fingerprint: the tokenizer's fingerprint.
        created: Unix seconds this gateway loaded it (``/v1/models``' ``created``).
    """

    spec: ModelSpec
    tokenizer: Any
    fingerprint: str
    created: int

    @property
    def name(self) -> str:
        """The model's id."""
        return self.spec.name


@dataclass(frozen=True)
class ResolvedModel:
    """What a request's ``model`` names.

    Attributes:
        name: the name the request gave (an id, alias or adapter; responses echo it).
        model_id: the base model's id; it names the request streams.
        tokenizer: the base model's tokenizer and chat template.
        lora_name: the adapter to run ("" = the base model).
        max_model_len: the context length in tokens (the smallest a ready worker announces,
            else the tokenizer's).
        task: "generate" or "embed".
    """

    name: str
    model_id: str
    tokenizer: Any
    lora_name: str = ""
    max_model_len: int = 0
    task: str = "generate"

    def stream(self, priority: int) -> str:
        """The base model's shared request stream of ``priority``."""
        return stream_name(priority, self.model_id)


@dataclass(frozen=True)
class ModelEntry:
    """One line of ``/v1/models`` and gRPC ``ListModels``.

    Attributes:
        id: the name a client sends.
        created: Unix seconds.
        max_model_len: context length in tokens.
        parent: the base model's id for an adapter; "" otherwise.
        root: the model's id (for an alias or adapter, the model it runs on).
        scale_from_zero: configured, but no ready worker now.
        task: "generate" or "embed".
    """

    id: str
    created: int
    max_model_len: int
    parent: str = ""
    root: str = ""
    scale_from_zero: bool = False
    task: str = "generate"


@dataclass
class _View:
    """The announcements read at ``at`` (monotonic s), sorted by worker id."""

    at: float = float("-inf")
    workers: list[Announcement] = field(default_factory=list)


def load_models(specs: list[ModelSpec], tokenizers: dict[str, Any] | None = None) -> list[ServedModel]:
    """Load each model's tokenizer (``common.tokenizer.load_tokenizer``, no torch) unless
    ``tokenizers`` (tests) has one under its name.

    Raises:
        FileNotFoundError, ValueError: a model's files are missing or unreadable.
    """
    from common.model_files import resolve_model_path
    from common.tokenizer import load_tokenizer

    now = int(time.time())
    out = []
    for spec in specs:
        tokenizer = (tokenizers or {}).get(spec.name)
        if tokenizer is None:
            tokenizer = load_tokenizer(resolve_model_path(spec.path))
        out.append(ServedModel(spec, tokenizer, tokenizer_fingerprint(tokenizer), now))
    return out


class ModelRegistry:
    """The configured models and the workers' announcements.

    Args:
        client: asyncio Redis (the heartbeats ``inflight:workers:*``: SCAN and GET).
        models: the configured models, the default one first (at least one).
    """

    def __init__(self, client: redis.asyncio.Redis, models: list[ServedModel]):
        if not models:
            raise ValueError("a gateway needs at least one model")
        self._redis = client
        self.models: dict[str, ServedModel] = {m.name: m for m in models}
        self.default = models[0]
        self._view = _View()
        self._logged: set[tuple[str, str]] = set()  # (worker id, reason) refusals already logged

    @classmethod
    def single(cls, client: redis.asyncio.Redis, name: str, tokenizer: Any) -> "ModelRegistry":
        """A registry of one model ``name`` served with ``tokenizer``."""
        return cls(client, [ServedModel(ModelSpec(name), tokenizer, tokenizer_fingerprint(tokenizer), int(time.time()))])

    # ------------------------------------------------------------------ workers
    async def announcements(self, max_age_s: float = ANNOUNCEMENTS_TTL_S) -> list[Announcement]:
        """Every ready worker's announcement, read again when the last read is older than
        ``max_age_s`` seconds; on a Redis failure the last ones read (none before the first)."""
        now = time.monotonic()
        if now - self._view.at < max_age_s:
            return self._view.workers
        try:
            keys = [k async for k in self._redis.scan_iter(match=f"{HEARTBEAT_PREFIX}*", count=100)]
            async with self._redis.pipeline(transaction=False) as pipe:  # GETs: the gateway's ACL has no MGET
                for key in keys:
                    pipe.get(key)
                values = await pipe.execute() if keys else []
        except (redis.RedisError, OSError) as exc:
            log.debug("worker announcements not read (%s): the last ones are used", exc)
            self._view.at = now
            return self._view.workers
        workers = []
        for key, value in zip(keys, values):
            worker_id = (key.decode() if isinstance(key, bytes) else key)[len(HEARTBEAT_PREFIX):]
            ann = Announcement.parse(worker_id, value)
            if ann is not None:
                workers.append(ann)
        self._view = _View(now, sorted(workers, key=lambda a: a.worker_id))
        for ann in self._view.workers:
            self._log_refusal(ann)
        return self._view.workers

    def refusal(self, ann: Announcement) -> str:
        """Why ``ann``'s worker is refused ("" when it is not): its model is not configured
        here, or its tokenizer's fingerprint is not the one this gateway holds."""
        model = self.models.get(ann.model)
        if not ann.model:
            return "announces no model (served_model_names is empty)"
        if model is None:
            return (f"serves model {ann.model!r}, which this gateway does not configure "
                    f"(configured: {', '.join(self.models)}); start the gateway with --model {ann.model}=PATH")
        if ann.tokenizer_fingerprint and ann.tokenizer_fingerprint != model.fingerprint:
            return (f"reports tokenizer fingerprint {ann.tokenizer_fingerprint} for model {ann.model!r}, this "
                    f"gateway holds {model.fingerprint}: not routed to, and {ann.model!r} is refused until they "
                    f"agree (give the gateway and the worker the same tokenizer files)")
        return ""

    def _log_refusal(self, ann: Announcement) -> None:
        reason = self.refusal(ann)
        if reason and (ann.worker_id, reason) not in self._logged:
            self._logged.add((ann.worker_id, reason))
            log.error("worker %s refused: %s", ann.worker_id, reason)

    async def refused_workers(self) -> dict[str, str]:
        """Worker id -> why it is refused, for every refused ready worker."""
        return {a.worker_id: r for a in await self.announcements() if (r := self.refusal(a))}

    async def accepted(self, model_id: str, max_age_s: float = ANNOUNCEMENTS_TTL_S) -> list[Announcement]:
        """The ready, not refused workers of ``model_id``."""
        return [a for a in await self.announcements(max_age_s) if a.model == model_id and not self.refusal(a)]

    async def has_worker(self, model_id: str) -> bool:
        """Whether a ready, not refused worker serves ``model_id`` (a "no" is checked against
        the heartbeats read again now: a worker that just started is not missed)."""
        return bool(await self.accepted(model_id) or await self.accepted(model_id, max_age_s=0.0))

    # ------------------------------------------------------------------ resolving
    def _task_of(self, model: ServedModel, workers: list[Announcement]) -> str:
        return workers[0].task if workers else model.spec.task

    def _max_model_len(self, model: ServedModel, workers: list[Announcement]) -> int:
        """The smallest context length (tokens) of the tokenizer's and the workers' announced ones
        (0: none known)."""
        lengths = [a.max_model_len for a in workers] + [int(getattr(model.tokenizer, "context_length", 0) or 0)]
        return min((n for n in lengths if n > 0), default=0)

    async def resolve_model(self, name: str | None, task: str | None = "generate",
                            allowed: Callable[[str, str], bool] | None = None) -> ResolvedModel:
        """The model a request's ``model`` names (None or "": the default model), which must
        serve ``task`` (None: any task, for a route that only needs its tokenizer).

        ``allowed(name, canonical)`` (a key's ``may_use``; ``canonical`` the adapter's name or
        the model's id) is asked first, before anything about the model is told: a name the
        caller may not use is a 404 whether it exists or not, never a 400 naming its task or a
        503 about its workers (docs/ADMISSION.md).

        Raises:
            ModelNotFoundError: no configured model, alias or adapter of that name, or not one
                ``allowed`` (404 ``model_not_found``).
            InvalidRequestError: the model serves another task (``model_not_supported``).
            UnavailableError: a ready worker of the model reports another tokenizer than
                this gateway holds (``tokenizer_mismatch``).
        """
        asked = name or self.default.name
        base, lora = self.models.get(asked), ""
        workers = await self.announcements()
        if base is None:  # an alias or adapter; one just loaded is in the heartbeats read now
            base, lora = self._announced(asked, workers)
            if base is None:
                workers = await self.announcements(max_age_s=UNKNOWN_NAME_TTL_S)
                base, lora = self._announced(asked, workers)
        if base is None or (allowed is not None and not allowed(asked, lora or base.name)):
            raise ModelNotFoundError(asked)
        mismatched = [a for a in workers if a.model == base.name and self.refusal(a)]
        if mismatched:
            raise UnavailableError(f"model {asked!r} is refused for now: a worker of it reports another tokenizer "
                                   f"than this gateway holds (the gateway's log and /fleet name it)",
                                   code="tokenizer_mismatch")
        mine = [a for a in workers if a.model == base.name]
        served_task = self._task_of(base, mine)
        if task is not None and served_task != task:
            raise InvalidRequestError(f"model {asked!r} serves {served_task!r} requests, not {task!r}",
                                      param="model", code="model_not_supported")
        return ResolvedModel(asked, base.name, base.tokenizer, lora, self._max_model_len(base, mine), served_task)

    def _announced(self, name: str, workers: list[Announcement]) -> tuple[ServedModel | None, str]:
        """(the configured model, the adapter) that a not refused worker serves as ``name``
        (an alias: adapter ""), or (None, ""); one thing per name (:meth:`_names`)."""
        model, adapter = self._names(workers).get(name, ("", ""))
        return (self.models[model], adapter) if model else (None, "")

    def _names(self, workers: list[Announcement]) -> dict[str, tuple[str, str]]:
        """Every name requests may send -> ``(model id, adapter name or "")``, so that a name is
        one thing: the configured models' ids first, then the not refused workers' aliases and
        adapters, the earliest started worker's first (its aliases before its adapters). A later
        claim of a name already taken by something else (an alias that is another model's id or
        another worker's adapter, one adapter name on two base models) is ignored and logged at
        ERROR once per worker and name: requests naming it keep reaching what they reached."""
        names: dict[str, tuple[str, str]] = {name: (name, "") for name in self.models}
        for ann in sorted(workers, key=lambda a: (a.started, a.worker_id)):
            if self.refusal(ann):
                continue
            claims = [(alias, (ann.model, "")) for alias in ann.served_model_names[1:]]
            claims += [(adapter, (ann.model, adapter)) for adapter in ann.adapters]
            for name, target in claims:
                held = names.setdefault(name, target)
                if held != target and (ann.worker_id, "name " + name) not in self._logged:
                    self._logged.add((ann.worker_id, "name " + name))
                    log.error("worker %s announces %r as %s of model %s, but %r is already %s; ignored "
                              "(give one of them another name)", ann.worker_id, name,
                              "an adapter" if target[1] else "an alias", target[0], name, _what(held))
        return names

    async def listing(self) -> list[ModelEntry]:
        """``/v1/models``: every configured model (``scale_from_zero`` when no ready worker
        serves it), the aliases its ready workers announce, and their adapters (``parent``:
        the base model)."""
        workers = await self.announcements()
        names = self._names(workers)
        out: list[ModelEntry] = []
        seen: set[str] = set()
        for model in self.models.values():
            mine = [a for a in workers if a.model == model.name and not self.refusal(a)]
            length, task = self._max_model_len(model, mine), self._task_of(model, mine)
            out.append(ModelEntry(model.name, model.created, length, root=model.name,
                                  scale_from_zero=not mine, task=task))
            seen.add(model.name)
            for ann in mine:
                for alias in ann.served_model_names[1:]:
                    if alias not in seen and names.get(alias) == (model.name, ""):
                        seen.add(alias)
                        out.append(ModelEntry(alias, model.created, length, root=model.name, task=task))
            for ann in mine:
                for adapter in ann.adapters:
                    if adapter not in seen and names.get(adapter) == (model.name, adapter):
                        seen.add(adapter)
                        out.append(ModelEntry(adapter, int(ann.started) or model.created, length,
                                              parent=model.name, root=model.name, task=task))
        return out


def _what(target: tuple[str, str]) -> str:
    """How a log line names what a name resolves to."""
    model, adapter = target
    return f"an adapter of model {model}" if adapter else f"model {model} (its id or an alias)"


class ModelScope:
    """A gateway service seen through one resolved model: ``tokenizer`` and ``max_model_len``
    are the model's, ``model`` is the :class:`ResolvedModel`, anything else is the service's
    (``settings``, ``metrics``, ...). The tokenizer routes' work functions
    (gateway/rest/tokenize.py) take one in place of the service.
    """

    def __init__(self, service: Any, model: ResolvedModel):
        self._service = service
        self.model = model
        self.tokenizer = model.tokenizer
        self.max_model_len = model.max_model_len

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)
