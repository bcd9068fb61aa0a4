"""The web page the gateway serves (llama.cpp's server has one too): a chat playground and a
live fleet view, plain files in ``gateway/rest/static/`` (no CDN, no build step), and the one
JSON endpoint the fleet view reads.

* ``GET /`` redirects to ``/ui/``; ``/ui/`` serves ``index.html``, ``app.js``, ``style.css``.
  The page calls the API with the key the person types in (kept in the tab's
  ``sessionStorage`` only).
* ``GET /fleet``: the fleet view (common/fleet.py, the data ``inflight status`` prints) for an
  admin key (``inflight keys create --admin``): 401 without a valid key, 403 for a key that
  is not an admin's, 503 when Redis does not answer.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

import httpx
import redis
from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from common.fleet import collect_fleet
from gateway.errors import PermissionDeniedError, redis_unavailable

STATIC_DIR = Path(__file__).resolve().parent / "static"


def install_webui(app: FastAPI, service) -> None:
    """Add ``/``, ``/ui/`` and ``/fleet`` to ``app`` (``service``: the ``GatewayService``,
    for authentication and its Redis client)."""

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/fleet", responses={200: {"description": "The fleet view (common/fleet.py FleetView.to_json)."},
                                  401: {"description": "No valid API key."},
                                  403: {"description": "The key is not an admin key."},
                                  503: {"description": "Redis unreachable."}})
    async def fleet(request: Request) -> dict:
        key = await service.admission.authenticate(request.headers.get("authorization"))
        if not key.admin:
            raise PermissionDeniedError("the fleet view needs an admin key (inflight keys create --admin)",
                                        code="admin_key_required")
        try:
            async with httpx.AsyncClient() as http:
                view = await collect_fleet(service.redis, http, models=tuple(service.models.models))
        except (redis.RedisError, OSError) as exc:
            raise redis_unavailable("the fleet view", exc) from exc
        refused = await service.models.refused_workers()  # another tokenizer, or a model not configured here
        view = dataclasses.replace(view, workers=[dataclasses.replace(w, refused=refused.get(w.worker_id, ""))
                                                  for w in view.workers])
        return view.to_json()

    app.mount("/ui", StaticFiles(directory=STATIC_DIR, html=True), name="ui")
