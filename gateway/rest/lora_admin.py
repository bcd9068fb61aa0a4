"""vLLM's LoRA admin endpoints, for admin keys only (``inflight keys create --admin``):

* ``POST /v1/load_lora_adapter`` ``{"lora_name": ..., "lora_path": ...}``: the workers of the
  base model load the PEFT adapter at ``lora_path`` (a path on the workers' machines) and serve
  it as ``lora_name``. 200 with vLLM's text once a worker reports it loaded; 400 naming why a
  worker refused it (rank above its ``--max-lora-rank``, a target module the model lacks,
  another base model's shapes or name, LoRA not enabled, no adapter at the path).
* ``POST /v1/unload_lora_adapter`` ``{"lora_name": ...}``: the workers stop serving it (requests
  running with it finish with it). 200, or 404 when no worker serves that adapter.

Both take an optional ``model`` (our extension): the base model whose workers act, by default
the gateway's default model. 401 without a valid key, 403 for a key that is not an admin's,
503 when Redis does not answer, 504 when no worker of the model reports within
``LORA_ADMIN_TIMEOUT_S`` (the operation stays desired: a worker that starts later applies it).
The operation travels through Redis (common/lora_control.py, worker/serve/lora_sync.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import redis
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from common.lora_control import LoraOp, desired_key, result_key
from gateway.errors import (DeadlineExceededError, InvalidRequestError, ModelNotFoundError, NotFoundError,
                            PermissionDeniedError, redis_unavailable)
from gateway.rest.error_handlers import is_json, not_json_error

#: Seconds the endpoint waits for the first worker's report.
LORA_ADMIN_TIMEOUT_S = 30.0
_POLL_S = 0.05
_RESPONSES = {200: {"description": "vLLM's text: the adapter was loaded / unloaded."},
              400: {"description": "A worker refused the adapter (the message says why), or a bad body."},
              401: {"description": "No valid API key."}, 403: {"description": "The key is not an admin key."},
              404: {"description": "Unload of an adapter no worker serves; an unknown model."},
              503: {"description": "Redis unreachable."},
              504: {"description": "No worker of the model answered in time."}}


def _body(*required: str) -> dict:
    """The OpenAPI request body of a route reading ``required`` strings (and the optional ``model``)
    itself, after the admin check."""
    fields = {name: {"type": "string", "minLength": 1} for name in (*required, "model")}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "properties": fields, "required": list(required)}}}}}


def install_lora_admin(app: FastAPI, service, timeout_s: float = LORA_ADMIN_TIMEOUT_S) -> None:
    """Add ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` to ``app`` (``service``: the
    ``GatewayService``, for authentication, its Redis client and its models)."""

    @app.post("/v1/load_lora_adapter", responses=_RESPONSES, response_class=PlainTextResponse,
              openapi_extra=_body("lora_name", "lora_path"))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await _admin_body(service, request)
        name, path = _adapter_name(body), _text(body, "lora_path")
        model = _base_model(service, body)
        await _check_load(service, name, model)
        await _run(service, model, LoraOp.load(name, path), timeout_s)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=_RESPONSES, response_class=PlainTextResponse,
              openapi_extra=_body("lora_name"))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await _admin_body(service, request)
        name = _text(body, "lora_name")
        await _run(service, _base_model(service, body), LoraOp.remove(name), timeout_s)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _admin_body(service, request: Request) -> dict:
    """The JSON body of an admin key's request.

    Raises:
        AuthenticationError (401), PermissionDeniedError (403), InvalidRequestError (400)."""
    key = await service.admission.authenticate(request.headers.get("authorization"))
    if not key.admin:
        raise PermissionDeniedError("loading and unloading LoRA adapters needs an admin key "
                                    "(inflight keys create --admin)", code="admin_key_required")
    if not is_json(request.headers.get("content-type", "")):
        raise not_json_error()  # as every other route answers
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise InvalidRequestError(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    return body


def _text(body: dict, field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"'{field}' must be a non-empty string", param=field)
    return value


#: What an adapter may be called: a model-name-like token (vLLM puts no rule; ours keeps names
#: out of log lines' and error bodies' way: no whitespace or control characters, 128 at most).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


def _adapter_name(body: dict) -> str:
    """``lora_name`` of a load request.

    Raises:
        InvalidRequestError: not a string matching :data:`ADAPTER_NAME`.
    """
    name = _text(body, "lora_name")
    if not ADAPTER_NAME.fullmatch(name):
        raise InvalidRequestError("'lora_name' must be 1 to 128 letters, digits or ._:/@+- (starting with a letter "
                                  "or digit)", param="lora_name")
    return name


async def _check_load(service, name: str, model: str) -> None:
    """What the gateway itself refuses of a load, from one read of its models' listing: a name
    resolves to one thing, so an adapter may not take a model's id or alias (requests naming it
    would run the adapter instead of that model) nor the name of an adapter loaded (or desired:
    its load waits for a worker) on another base model (the same name on ``model`` is a reload);
    and pooling workers (``--runner pooling``) serve no adapters (refused at once rather than
    waiting for a report none of them sends).

    Raises:
        InvalidRequestError: ``name`` is a model id or alias, or another base model's adapter
            (``lora_name_taken``, naming it), or ``model``'s ready workers serve embeddings
            (``model_not_supported``).
        UnavailableError: Redis unreachable (reading the other models' desired adapters).
    """
    registry = getattr(service, "models", None)
    entries = await registry.listing() if hasattr(registry, "listing") else []
    configured = list(getattr(registry, "models", {}) or ())
    taken = set(configured) | {service.settings.served_model_name}
    if name in taken | {entry.id for entry in entries if not entry.parent}:
        raise InvalidRequestError(f"'{name}' is already a model's name; give the adapter another lora_name",
                                  param="lora_name", code="lora_name_taken")
    other = next((entry.parent for entry in entries if entry.id == name and entry.parent and entry.parent != model),
                 None) or await _desired_elsewhere(service, name, model, configured)
    if other:
        raise InvalidRequestError(f"'{name}' is already an adapter of model '{other}'; give the adapter another "
                                  "lora_name (or unload it there first)", param="lora_name", code="lora_name_taken")
    if any(entry.id == model and entry.task == "embed" for entry in entries):
        raise InvalidRequestError(f"model '{model}' serves embeddings (--runner pooling), which take no LoRA "
                                  "adapters", param="model", code="model_not_supported")


async def _desired_elsewhere(service, name: str, model: str, configured: list[str]) -> str:
    """The other configured model whose desired adapter operations hold a load of ``name`` (one
    no ready worker announces yet), or "".

    Raises:
        UnavailableError: Redis unreachable.
    """
    for other in configured:
        if other == model:
            continue
        try:
            raw = await service.redis.hget(desired_key(other), name)
        except (redis.RedisError, OSError) as exc:
            raise redis_unavailable("loading LoRA adapters", exc) from exc
        op = LoraOp.from_json(name, raw) if raw is not None else None
        if op is not None and not op.unload:
            return other
    return ""


def _base_model(service, body: dict) -> str:
    """The model whose workers act: ``body["model"]`` when given (one the gateway serves), else
    the default model."""
    registry = getattr(service, "models", None)
    known = list(getattr(registry, "models", {}) or ()) or [service.settings.served_model_name]
    model = body.get("model")
    if model is None:
        default = getattr(registry, "default", None)
        return getattr(default, "name", None) or known[0]
    if not isinstance(model, str) or model not in known:
        raise ModelNotFoundError(str(model)[:200])
    return model


async def _run(service, model: str, op: LoraOp, timeout_s: float) -> None:
    """Write ``op`` for ``model``'s workers and wait for the first report.

    Raises:
        InvalidRequestError (400) / NotFoundError (404): the worker's refusal; the operation is
            withdrawn (the adapter's previous operation restored) so later workers do not retry it.
        DeadlineExceededError (504): no report within ``timeout_s``.
        UnavailableError (503): Redis unreachable.
    """
    client = service.redis
    try:
        previous = await client.hget(desired_key(model), op.name)
        await client.hset(desired_key(model), op.name, op.to_json())
        deadline = time.monotonic() + timeout_s
        while True:
            reports = await client.hgetall(result_key(op.op))
            if reports:
                break
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(f"no worker of model {model!r} reported the LoRA operation within "
                                            f"{timeout_s:g} s; it stays pending and applies when one starts")
            await asyncio.sleep(_POLL_S)
        report = json.loads(next(iter(reports.values())))
        if "error" in report:  # withdrawn (the previous operation back), unless another one replaced it
            current = await client.hget(desired_key(model), op.name)
            if current is not None and LoraOp.from_json(op.name, current) == op:
                if previous is None:
                    await client.hdel(desired_key(model), op.name)
                else:
                    await client.hset(desired_key(model), op.name, previous)
    except (redis.RedisError, OSError) as exc:
        raise redis_unavailable("loading LoRA adapters", exc) from exc
    if "error" in report:
        if report.get("status") == 404:
            raise NotFoundError(report["error"], param="lora_name")
        raise InvalidRequestError(report["error"], param="lora_path" if not op.unload else "lora_name",
                                  code="invalid_lora_adapter")
