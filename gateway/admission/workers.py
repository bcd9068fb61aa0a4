"""Admission refuses work nobody would take: with ``require_worker`` set, a request is
only admitted while a ready worker of its model announces itself in Redis (its heartbeat,
read by the model registry, gateway/model_registry.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.errors import UnavailableError

if TYPE_CHECKING:
    from gateway.model_registry import ModelRegistry

WORKER_HEARTBEAT_PATTERN = "inflight:workers:*"


class WorkerGate:
    """Checks that a ready, not refused worker serves the request's model
    (docs/CONTRACTS.md: ``inflight:workers:{id}``; announcements re-read at most once a second).

    Args:
        models: the gateway's model registry.
        require_worker: off = every request passes (tests, a deployment that scales from zero).
    """

    def __init__(self, models: "ModelRegistry", require_worker: bool):
        self._models = models
        self._required = require_worker

    async def check(self, model_id: str) -> None:
        """Pass, or raise when ``require_worker`` is set and no ready worker serves
        ``model_id``. A Redis failure keeps the last announcements read (the rate limiter
        that comes next reports Redis as unreachable).

        Raises:
            UnavailableError: code ``no_worker``.
        """
        if not self._required or await self._models.has_worker(model_id):
            return
        raise UnavailableError(f"no worker is serving the model {model_id!r} right now (none has sent a "
                               f"heartbeat in the last 10 s); retry shortly", code="no_worker")
