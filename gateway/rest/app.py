"""The OpenAI-compatible REST app (routes follow the OpenAI API reference).

``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` →
SSE), ``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready`` (Redis
answers and a worker heartbeat exists), ``GET /metrics`` (Prometheus).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from gateway.errors import InflightError, NotFoundError
from gateway.prompts import apply_completion_special_tokens
from gateway.rest import openai_format as fmt
from gateway.rest import schemas
from gateway.rest.body_limit import MAX_BODY_BYTES, BodyLimit
from gateway.rest.delivery import ClientGone, GenerationStream, collect_or_cancel, sse_stream
from gateway.rest.error_handlers import install_error_handlers
from gateway.rest.request_counter import RequestCounter
from gateway.rest.unsupported import check_unsupported
from gateway.service import GatewayService

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Prompt and completion text, at DEBUG, only with ``GatewaySettings.log_content``.
content_log = logging.getLogger("gateway.content")
CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request"


def create_app(service: GatewayService, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving ``service``; request bodies above ``max_body_bytes`` bytes
    get 413 (see ``gateway.rest.body_limit``)."""
    app = FastAPI(title="inflight gateway", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, service.metrics)
    app.add_middleware(BodyLimit, limit_bytes=max_body_bytes)  # inside the request counter
    app.add_middleware(RequestCounter, metrics=service.metrics)
    model = service.settings.served_model_name
    started = int(time.time())
    if service.settings.log_content:
        content_log.setLevel(logging.DEBUG)  # the switch, not the root level, decides

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = await service.ready()
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        await service.refresh_queue_depth()
        service.metrics.waiting_clients.set(len(service.router))
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> schemas.ModelList:
        await service.authenticate(request.headers.get("authorization"))
        card = schemas.ModelCard(id=model, created=started,
                                 context_length=service.tokenizer.context_length)
        return schemas.ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str, request: Request) -> schemas.ModelCard:
        await service.authenticate(request.headers.get("authorization"))
        if model_id != model:
            raise NotFoundError(f"model {model_id!r} does not exist; this server serves {model!r}",
                                param="model", code="model_not_found")
        return schemas.ModelCard(id=model, created=started, context_length=service.tokenizer.context_length)

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        key = await service.authenticate(request.headers.get("authorization"))
        check_unsupported(body)
        prompt = await _completion_prompt(service, body.prompt)
        vreq = await service.validate(key, prompt=prompt, **_sampling(body),
                                return_logprobs=body.logprobs is not None,
                                top_logprobs=body.logprobs)
        gen = await service.submit(key, vreq)
        on_text = _log_content(service, gen.request_id, "prompt", body.prompt)
        created = int(time.time())
        if body.stream:
            chunk = functools.partial(fmt.completion_chunk, gen.request_id, model, created)
            return GenerationStream(gen, sse_stream(gen, chunk, _include_usage(body), on_text=on_text),
                                    _sse_headers(gen))
        return await _respond(request, gen, lambda t: fmt.completion_response(
            gen.request_id, model, created, t), on_text)

    @app.post("/v1/chat/completions")
    async def chat(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        key = await service.authenticate(request.headers.get("authorization"))
        check_unsupported(body)
        params = _sampling(body)
        if body.max_completion_tokens is not None:
            params["max_tokens"] = body.max_completion_tokens
        vreq = await service.validate(key, messages=body.messages, **params,
                                return_logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs)
        gen = await service.submit(key, vreq)
        on_text = _log_content(service, gen.request_id, "messages", body.messages)
        created = int(time.time())
        if body.stream:
            chunk = functools.partial(fmt.chat_chunk, gen.request_id, model, created)
            first = chunk(role=True, text="")
            return GenerationStream(gen, sse_stream(gen, chunk, _include_usage(body), first, on_text),
                                    _sse_headers(gen))
        return await _respond(request, gen, lambda t: fmt.chat_response(
            gen.request_id, model, created, t), on_text)

    return app


async def _completion_prompt(service: GatewayService, prompt):
    """``prompt`` under the ``completion_special_tokens`` setting (``gateway.prompts``);
    ``escape`` and ``reject`` tokenize here, off the event loop, and hand on token ids."""
    mode = service.settings.completion_special_tokens
    if mode == "allow":
        return prompt
    try:
        return await asyncio.to_thread(apply_completion_special_tokens, service.tokenizer, prompt, mode)
    except InflightError:
        service.metrics.rejections.labels(reason="invalid_request").inc()
        raise


def _sse_headers(gen) -> dict[str, str]:
    """SSE headers plus ``X-Request-Id``, as the non-streaming responses carry."""
    return {**SSE_HEADERS, "X-Request-Id": gen.request_id}


def _sampling(body: schemas._SamplingFields) -> dict:
    return dict(model=body.model, max_tokens=body.max_tokens, temperature=body.temperature,
                top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop, n=body.n,
                priority=body.priority, stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos, skip_special_tokens=body.skip_special_tokens)


def _include_usage(body: schemas._SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _log_content(service: GatewayService, request_id: str, what: str, value):
    """With ``log_content`` on: log the request's prompt or messages now, and return the
    callback that logs its completion text; off: None, nothing logged."""
    if not service.settings.log_content:
        return None
    content_log.debug("%s %s: %r", request_id, what, value, extra={"request_id": request_id})
    return lambda text: content_log.debug("%s completion: %r", request_id, text,
                                          extra={"request_id": request_id})


async def _respond(request: Request, gen, build, on_text=None) -> Response:
    try:
        transcript = await collect_or_cancel(request, gen)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    if on_text is not None:
        on_text("".join(transcript.text))
    return JSONResponse(build(transcript).model_dump(), headers={"X-Request-Id": gen.request_id})
