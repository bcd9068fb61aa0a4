"""``/v1/responses``: OpenAI's Responses API on the chat completions' engine path.

``POST /v1/responses`` turns its body into chat messages, tools and a constraint
(``gateway.rest.responses_input``), admits and queues it as a chat request
(``GatewayService.submit``: the same validation, windows, caps and queue), and answers
with a ``response`` object or, with ``stream: true``, its typed events
(``response.created``, ``response.in_progress``, the items' events of
``gateway.rest.responses_output``, then ``response.completed``, or
``response.incomplete`` when ``max_output_tokens`` cut it, or ``response.failed``).
With ``store`` (default true, as OpenAI) the response and its conversation are kept in
Redis under the key's id (``gateway.responses_store``) for ``previous_response_id``,
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}``; a key never sees another
key's responses (404).
A stream resumes as chat's does (``Last-Event-ID``, gateway/rest/responses_stream.py): the
response's ids (``resp_…``, the items') derive from its internal request id, so a resuming
gateway rebuilds the events the client has and sends the rest.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from common.reasoning import ReasoningFormat
from gateway.admission.params import RequestParams
from gateway.admission.structured import structured_outputs_from_fields
from gateway.errors import InflightError, InvalidRequestError, NotFoundError, error_body
from gateway.keys import KeyRecord
from gateway.responses_store import ResponsesStore, StoredResponse
from gateway.rest import openapi_doc as doc
from gateway.rest.delivery import CLIENT_CLOSED_STATUS, ClientGone, GenerationStream, collect_or_cancel
from gateway.rest.responses_input import chat_tool_choice, chat_tools, input_messages, response_format
from gateway.rest.responses_output import OutputBuilder, output_messages, usage_of
from gateway.rest.responses_stream import ResponseEvents
from gateway.rest.resume_header import resume_point_of, visible_id
from gateway.rest.stream_rebuild import StableIds
from gateway.rest.responses_schemas import ResponseCreateRequest, ResponseDeleted, ResponseObject
from gateway.rest.unsupported import _is_neutral
from gateway.service import Generation, GatewayService
from gateway.tools.request import tool_fields
from protos import common_pb2, link_pb2

#: Fields served only at their neutral values (anything else: 400 ``unsupported_parameter``).
NEUTRAL = {"background": (None, False), "conversation": (None,), "prompt": (None,),
           "truncation": (None, "disabled"), "top_logprobs": (None, 0)}

_SSE_DOC = {200: {"description": "The response (JSON), or with `stream: true` its events (SSE: "
                                 "`event: <type>` and `data: <event JSON>` frames, each with its "
                                 "`sequence_number`, ending with `response.completed`, "
                                 "`response.incomplete` or `response.failed`).",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            **doc.error_responses(*doc.GENERATION_ERRORS)}


@dataclass
class _Turn:
    """What one create call needs after its body was read: the request echo and the
    conversation before this response's output."""

    body: ResponseCreateRequest
    model: str
    response_id: str
    created_at: int
    store: bool
    messages: list[dict[str, Any]]  # the conversation without instructions, for the store


def _check_unsupported(body: ResponseCreateRequest) -> None:
    for name, neutral in NEUTRAL.items():
        value = getattr(body, name)
        if not _is_neutral(value, neutral):
            raise InvalidRequestError(f"{name}={value!r} is not supported by this server",
                                      param=name, code="unsupported_parameter")


_CHAT_TOOL = re.compile(r"\btools\[(\d+)\]\.function\b")


def responses_field_names(err: InflightError) -> InflightError:
    """``err``, raised by the chat path that serves this route, with the Responses API's field
    names in its ``param`` and message: ``max_output_tokens`` for chat's ``max_tokens``,
    ``input`` for ``messages`` (the conversation built from it), and the flat
    ``tools[i].name`` for chat's ``tools[i].function.name``. A client reading ``param``
    otherwise hears of fields it never sent."""
    param = err.param or ""
    if param == "max_tokens":
        err.param = "max_output_tokens"
        err.message = re.sub(r"\bmax_tokens\b", "max_output_tokens", err.message)
    elif param == "messages" or param.startswith("messages["):
        err.param = "input"
        err.message = err.message.replace("'messages'", "'input'")
    elif _CHAT_TOOL.search(param):
        err.param = _CHAT_TOOL.sub(r"tools[\1]", param)
        err.message = _CHAT_TOOL.sub(r"tools[\1]", err.message)
    return err


def _text_format(body: ResponseCreateRequest) -> dict[str, Any]:
    """``RequestParams`` fields of ``text.format`` (errors name ``text.format``)."""
    try:
        found = structured_outputs_from_fields(response_format(body.text))
    except InvalidRequestError as err:
        for old in ("response_format.json_schema.schema", "response_format.json_schema", "response_format"):
            if err.param and err.param.startswith(old):
                new = "text.format.schema" if old.endswith("schema.schema") else "text.format"
                err.param = new + err.param[len(old):]
                err.message = err.message.replace(old, new)
                break
        raise
    if found is None:
        return {}
    param = "text.format.schema" if found[1] == "response_format.json_schema.schema" else "text.format"
    return {"structured_outputs": found[0], "structured_outputs_param": param}


def request_params(body: ResponseCreateRequest, messages: list[dict[str, Any]]) -> RequestParams:
    """The chat request a Responses body asks for (``messages`` already hold the
    instructions, the previous turns and ``input``).

    Raises:
        InvalidRequestError: malformed tools, tool choice or text format.
    """
    fields = _text_format(body)
    constraint = ((fields["structured_outputs"], "text.format") if fields else None)
    fields.update(tool_fields(chat_tools(body.tools), chat_tool_choice(body.tool_choice),
                              body.parallel_tool_calls, constraint))
    return RequestParams(messages=messages, model=body.model, max_tokens=body.max_output_tokens,
                         temperature=body.temperature, top_p=body.top_p, **fields)


def _response(turn: _Turn, status: str, output: list[dict], usage: common_pb2.Usage | None,
              error: dict | None = None, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The ``response`` object of ``turn`` as it stands."""
    body = turn.body
    text = body.text if isinstance(body.text, dict) and body.text.get("format") else {"format": {"type": "text"}}
    return ResponseObject(
        id=turn.response_id, created_at=turn.created_at, status=status, error=error,
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        instructions=body.instructions, max_output_tokens=body.max_output_tokens, model=turn.model,
        output=output, parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id, store=turn.store,
        temperature=body.temperature, top_p=body.top_p, text=text,
        tool_choice=body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
        tools=list(body.tools or []), usage=usage_of(usage, reasoning_tokens) if usage is not None else None,
        metadata=body.metadata or {}).model_dump()


def responses_router(service: GatewayService, reasoning: ReasoningFormat | None) -> APIRouter:
    """The ``/v1/responses`` routes on ``service``; ``reasoning`` is the server's reasoning
    format (None: off)."""
    router = APIRouter()
    store = ResponsesStore(service.redis, service.settings.responses_ttl_s)

    async def authenticate(request: Request) -> KeyRecord:
        return await service.admission.authenticate(request.headers.get("authorization"))

    async def finish(turn: _Turn, key: KeyRecord, builder: OutputBuilder, gen: Generation,
                     incomplete: bool) -> dict[str, Any]:
        response = _response(turn, "incomplete" if incomplete else "completed", builder.items, gen.usage,
                             reasoning_tokens=builder.reasoning_tokens)
        if turn.store:
            await store.save(key.key_id, StoredResponse(response, turn.messages + output_messages(builder.items)))
        return response

    @router.post("/v1/responses", response_model=ResponseObject, responses=_SSE_DOC)
    async def create(body: ResponseCreateRequest, request: Request) -> Response:
        key = await authenticate(request)
        _check_unsupported(body)
        resume = await resume_point_of(service, key, request, body.stream)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = await store.load(key.key_id, body.previous_response_id)
            if previous is None:
                raise NotFoundError(f"previous response {body.previous_response_id!r} not found",
                                    param="previous_response_id", code="previous_response_not_found")
            history = previous.messages
        messages = history + input_messages(body.input, history)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            gen = await service.submit(key, request_params(body, system + messages), resume=resume,
                                       visible_id=visible_id(request))
        except InflightError as err:
            raise responses_field_names(err) from None
        ids = StableIds(gen.internal_id)  # the same on a gateway that resumes the stream
        created = resume.created if resume is not None else int(time.time())
        turn = _Turn(body, gen.request.model, ids("resp"), created, body.store is not False, messages)
        tools = gen.request.tools if gen.request.tools and gen.request.tools.parses_calls else None
        builder = OutputBuilder(tools, reasoning, ids)
        headers = {"X-Request-Id": gen.request_id, **gen.rate_limit_headers}
        if body.stream:
            stream = ResponseEvents(gen.request_id, builder)
            if resume is not None:
                stream.restore(_response(turn, "in_progress", [], None), resume.pieces, resume.after)
            await service.start_journal(gen, created, key)
            return GenerationStream(gen, _events(turn, key, gen, stream, finish),
                                    {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
                                    service.settings.stream_idle_timeout_s)
        try:
            transcript = await collect_or_cancel(request, gen)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except InflightError as err:
            err.headers.update(gen.rate_limit_headers)
            raise
        (_, choice), = transcript.ordered()
        for text, tokens in choice.pieces():
            builder.feed(text, tokens)
        incomplete = choice.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        builder.finish(incomplete)
        return JSONResponse(await finish(turn, key, builder, gen, incomplete), headers=headers)

    @router.get("/v1/responses/{response_id}", response_model=ResponseObject,
                responses=doc.error_responses(401, 404, 503))
    async def retrieve(response_id: str, request: Request) -> JSONResponse:
        key = await authenticate(request)
        found = await store.load(key.key_id, response_id)
        if found is None:
            raise _not_found(response_id)
        return JSONResponse(found.response)

    @router.delete("/v1/responses/{response_id}", response_model=ResponseDeleted,
                   responses=doc.error_responses(401, 404, 503))
    async def delete(response_id: str, request: Request) -> ResponseDeleted:
        key = await authenticate(request)
        if not await store.delete(key.key_id, response_id):
            raise _not_found(response_id)
        return ResponseDeleted(id=response_id)

    return router


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"response {response_id!r} not found", param="response_id", code="response_not_found")


async def _events(turn: _Turn, key: KeyRecord, gen: Generation, stream: ResponseEvents,
                  finish) -> AsyncIterator[bytes]:
    """The SSE frames of a streamed response (module docstring); a resumed one
    (``gen.resumed``, ``stream`` restored) sends only what follows the client's offset."""
    builder = stream.builder
    if not gen.resumed:
        yield stream.start(_response(turn, "in_progress", [], None))
    try:
        async for event in gen.events():
            if isinstance(event, link_pb2.Delta):
                frames = stream.delta(event.text, len(event.token_ids))
                if frames:
                    yield frames
                continue
            incomplete = event.finish_reason == common_pb2.FINISH_REASON_LENGTH
            items = builder.finish(incomplete)
            response = await finish(turn, key, builder, gen, incomplete)
            kind = "response.incomplete" if incomplete else "response.completed"
            yield stream.end([*items, {"type": kind, "response": response}])
    except InflightError as exc:
        error = error_body(exc)["error"]
        failed = _response(turn, "failed", builder.items, None,
                           error={"code": error.get("code") or error["type"], "message": error["message"]})
        yield stream.writer.frame({"type": "response.failed", "response": failed})
