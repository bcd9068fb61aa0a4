"""The OpenAI-compatible REST app (routes follow the OpenAI API reference).

``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` →
SSE), ``GET /v1/models``, ``GET /health`` (liveness), ``GET /ready`` (Redis
answers and a worker heartbeat exists), ``GET /metrics`` (Prometheus),
``GET /openapi.json`` (the schema of all these, ``gateway.rest.openapi_doc``); vLLM's
``POST /tokenize`` and ``POST /detokenize`` (``gateway.rest.tokenize``); Anthropic's
``POST /v1/messages`` and ``/v1/messages/count_tokens`` (``gateway.rest.messages``);
``POST /v1/embeddings`` (``gateway.rest.embeddings``); the web
page (``/ui/``) and ``GET /fleet`` (``gateway.rest.webui``).
"""

from __future__ import annotations

import functools
import logging
import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from common.reasoning import reasoning_format
from gateway.errors import InflightError, ModelNotFoundError
from gateway.rest import openai_format as fmt
from gateway.rest import openapi_doc as doc
from gateway.rest import schemas
from gateway.rest.api_key import authorization_of
from gateway.rest.body_limit import MAX_BODY_BYTES, BodyLimit
from gateway.rest.delivery import (CLIENT_CLOSED_STATUS, ClientGone, GenerationStream, StreamUsage,
                                   collect_or_cancel, sse_stream)
from gateway.rest.auth_first import install_auth_first
from gateway.rest.error_handlers import install_error_handlers
from gateway.rest.params import chat_params, completion_params
from gateway.rest.request_counter import RequestCounter
from gateway.rest.reasoning_stream import ReasoningChunks
from gateway.rest.responses import responses_router
from gateway.rest.request_id_header import RequestIdHeader
from gateway.rest.resume_header import resume_point_of, visible_id
from gateway.rest.embeddings import embeddings_router
from gateway.rest.messages import messages_router
from gateway.rest.tokenize import tokenize_router
from gateway.rest.tool_stream import ToolCallChunks
from gateway.rest.unsupported import check_unsupported
from gateway.rest.lora_admin import install_lora_admin
from gateway.rest.webui import install_webui
from gateway.service import GatewayService

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Prompt and completion text, at DEBUG, only with ``GatewaySettings.log_content``.
content_log = logging.getLogger("gateway.content")


def create_app(service: GatewayService, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving ``service``; request bodies above ``max_body_bytes`` bytes
    get 413 (see ``gateway.rest.body_limit``)."""
    app = FastAPI(title="inflight gateway", version=fmt.VERSION, docs_url=None, redoc_url=None,
                  openapi_url=doc.OPENAPI_URL,
                  description="OpenAI-compatible completions and chat completions (see README.md).")
    install_error_handlers(app, service.metrics)
    doc.install_openapi(app)
    app.add_middleware(BodyLimit, limit_bytes=max_body_bytes)  # inside the request counter
    app.add_middleware(RequestCounter, metrics=service.metrics)
    build_stack = app.build_middleware_stack  # outside Starlette's own 500 handler too
    app.build_middleware_stack = lambda: RequestIdHeader(build_stack())
    reasoning = (reasoning_format(service.settings.reasoning_parser)
                 if service.settings.reasoning_parser else None)
    if service.settings.log_content:
        content_log.setLevel(logging.DEBUG)  # the switch, not the root level, decides

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", responses={200: {"description": "Redis answers and a worker is alive."},
                                  503: {"description": "Not ready (no Redis or no worker)."}})
    async def ready() -> JSONResponse:
        ok = await service.ready()
        return JSONResponse({"status": "ready" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format."}})
    async def metrics() -> Response:
        await service.refresh_queue_depth()
        service.metrics.waiting_clients.set(len(service.request_table))
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=doc.error_responses(*doc.MODELS_ERRORS))
    async def models(request: Request) -> schemas.ModelList:
        # x-api-key too: the anthropic package's models.list() sends only that header
        key = await service.admission.authenticate(authorization_of(request))
        return schemas.ModelList(data=[schemas.model_card(e) for e in await service.models.listing()
                                       if key.may_use(e.id)])

    @app.get("/v1/models/{model_id:path}", responses=doc.error_responses(*doc.MODEL_ERRORS))
    async def model_card(model_id: str, request: Request) -> schemas.ModelCard:
        key = await service.admission.authenticate(authorization_of(request))
        for entry in await service.models.listing():
            if entry.id == model_id and key.may_use(entry.id):
                return schemas.model_card(entry)
        raise ModelNotFoundError(model_id)

    @app.post("/v1/completions", response_model=schemas.CompletionResponse,
              responses=doc.generation_responses(schemas.CompletionChunk))
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        key = await service.admission.authenticate(request.headers.get("authorization"))
        check_unsupported(body)
        resume = await resume_point_of(service, key, request, body.stream)
        gen = await service.submit(key, completion_params(body), resume=resume, visible_id=visible_id(request))
        on_text = _log_content(service, gen.request_id, "prompt", body.prompt)
        created = resume.created if resume is not None else int(time.time())
        if body.stream:
            await service.start_journal(gen, created, key)
            chunk = functools.partial(fmt.completion_chunk, gen.request_id, gen.request.model, created)
            return GenerationStream(gen, sse_stream(gen, chunk, _stream_usage(body), on_text=on_text,
                                                    seen=resume.after if resume is not None else 0),
                                    _sse_headers(gen), service.settings.stream_idle_timeout_s)
        return await _respond(request, gen, lambda t: fmt.completion_response(
            gen.request_id, gen.request.model, created, t), on_text)

    @app.post("/v1/chat/completions", response_model=schemas.ChatCompletionResponse,
              responses=doc.generation_responses(schemas.ChatCompletionChunk))
    async def chat(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        key = await service.admission.authenticate(request.headers.get("authorization"))
        check_unsupported(body)
        resume = await resume_point_of(service, key, request, body.stream)
        gen = await service.submit(key, chat_params(body), resume=resume, visible_id=visible_id(request))
        on_text = _log_content(service, gen.request_id, "messages", body.messages)
        created = resume.created if resume is not None else int(time.time())
        tools = gen.request.tools if gen.request.tools and gen.request.tools.parses_calls else None
        if body.stream:
            await service.start_journal(gen, created, key)
            chunk = functools.partial(fmt.chat_chunk, gen.request_id, gen.request.model, created)
            # as OpenAI: each choice's first chunk has the role (and empty content)
            first = [chunk(role=True, text="", index=i) for i in range(gen.request.n)]
            build = chunk if tools is None else ToolCallChunks(chunk, tools, gen.internal_id)
            if reasoning is not None:
                build = ReasoningChunks(chunk, build, reasoning)
            return GenerationStream(gen, sse_stream(gen, build, _stream_usage(body), first, on_text, reasoning,
                                                    resume.deltas if resume is not None else (),
                                                    resume.after if resume is not None else 0),
                                    _sse_headers(gen), service.settings.stream_idle_timeout_s)
        return await _respond(request, gen, lambda t: fmt.chat_response(
            gen.request_id, gen.request.model, created, t, tools, reasoning), on_text)

    app.include_router(tokenize_router(service))
    app.include_router(embeddings_router(service))
    app.include_router(messages_router(service))
    app.include_router(responses_router(service, reasoning))
    install_webui(app, service)  # GET /, /ui/ (the web page), /fleet
    install_lora_admin(app, service)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (admin keys)
    install_auth_first(app, service.admission)  # a bad key is 401 whatever the body
    return app


def _headers(gen) -> dict[str, str]:
    """What every generation response carries: ``X-Request-Id`` and the key's rate-limit headers."""
    return {"X-Request-Id": gen.request_id, **gen.rate_limit_headers}


def _sse_headers(gen) -> dict[str, str]:
    """SSE headers plus those of :func:`_headers`, as the non-streaming responses carry."""
    return {**SSE_HEADERS, **_headers(gen)}


def _stream_usage(body: schemas._SamplingFields) -> StreamUsage:
    """``stream_options``: vLLM reports continuous usage only with ``include_usage`` too."""
    options = body.stream_options
    if options is None or not options.include_usage:
        return StreamUsage()
    return StreamUsage(include=True, continuous=options.continuous_usage_stats)


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
    except InflightError as err:  # after admission: the error carries the key's headers too
        err.headers.update(gen.rate_limit_headers)
        raise
    if on_text is not None:
        for text in transcript.texts():
            on_text(text)
    return JSONResponse(build(transcript).model_dump(), headers=_headers(gen))
