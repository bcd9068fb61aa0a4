"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API
on the chat completions' engine path (the official ``anthropic`` client works against it).

A request is authenticated (``x-api-key`` or ``Authorization: Bearer``), converted to a
chat request (``gateway.rest.anthropic_format``) and submitted as one: the same
validation, tool prompt and call grammar, admission, queue and worker. Its output is
answered as a ``message`` or streamed as Anthropic's events; every error, before or
during a stream, has Anthropic's shape. ``count_tokens`` renders the prompt as the
request would be rendered and answers ``{"input_tokens"}``, admitted like ``/tokenize``
(the key's requests/min only, never queued).
A stream resumes as chat's does: every event has an ``id:`` line, and the same body sent
again with ``Last-Event-ID`` gets the events after it (:meth:`_Answer.restore`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, SkipValidation, StrictBool, StrictFloat, StrictInt

from common.reasoning import ReasoningFormat, reasoning_format
from gateway.admission.params import RequestParams
from gateway.errors import InflightError
from gateway.prompts import chat_prompt_ids
from gateway.rest import anthropic_format as anth
from gateway.rest import openapi_doc as doc
from gateway.rest.api_key import authorization_of
from gateway.rest.delivery import CLIENT_CLOSED_STATUS, GenerationStream
from gateway.rest.resume_header import resume_point_of, visible_id
from gateway.rest.stream_rebuild import StableIds, closing_frames, with_id
from gateway.rest.tokenize import admit_unqueued
from gateway.service import Generation, GatewayService
from gateway.stream_journal import ResumePoint
from gateway.tools.request import tool_fields
from protos import link_pb2

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class AnthropicTextBlock(BaseModel):
    """``{"type": "text", "text"}``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class AnthropicToolUseBlock(BaseModel):
    """An assistant's earlier call: ``{"type": "tool_use", "id", "name", "input"}``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicToolResultBlock(BaseModel):
    """A call's result in a user turn: ``tool_use_id``, ``content`` (text or text blocks)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicTextBlock] = ""
    is_error: bool | None = None


class AnthropicMessageParam(BaseModel):
    """One turn: ``role`` user or assistant, ``content`` a string or blocks."""

    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[AnthropicTextBlock | AnthropicToolUseBlock | AnthropicToolResultBlock]


class AnthropicToolParam(BaseModel):
    """A custom tool: ``name``, ``description``, ``input_schema`` (a JSON schema object)."""

    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoiceParam(BaseModel):
    """``{"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _PromptFields(BaseModel):
    """What both routes read: the conversation and the tools (checked by
    ``gateway.rest.anthropic_format``, so errors name the field the same way)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: SkipValidation[list[AnthropicMessageParam]]
    system: SkipValidation[str | list[AnthropicTextBlock] | None] = None
    tools: SkipValidation[list[AnthropicToolParam] | None] = None
    tool_choice: SkipValidation[AnthropicToolChoiceParam | None] = None


class MessagesRequest(_PromptFields):
    """``POST /v1/messages`` body (``max_tokens`` required, as Anthropic's)."""

    max_tokens: StrictInt
    stop_sequences: list[str] | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = False
    metadata: Any = None


class CountTokensRequest(_PromptFields):
    """``POST /v1/messages/count_tokens`` body."""


class AnthropicUsage(BaseModel):
    """Anthropic's usage (tokens)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class AnthropicMessage(BaseModel):
    """The ``message`` answer."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(BaseModel):
    """``count_tokens``' answer: the prompt's tokens."""

    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    """The inner object of Anthropic's error body."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, ``{"type": "error", "error": {"type", "message"}}``."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return doc.error_responses(*codes, body=AnthropicErrorResponse)


def _chat_fields(body: _PromptFields) -> dict[str, Any]:
    """The chat request's messages and tool fields for ``body``."""
    messages = anth.chat_messages(body.system, body.messages)
    tools, choice, parallel = anth.openai_tools(body.tools, body.tool_choice)
    return {"messages": messages, **tool_fields(tools, choice, parallel, None)}


def request_params(body: MessagesRequest) -> RequestParams:
    """The chat :class:`RequestParams` of a Messages request.

    Raises:
        InvalidRequestError: a malformed message, block or tool (naming it).
    """
    return RequestParams(model=body.model, max_tokens=body.max_tokens, temperature=body.temperature,
                         top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences,
                         **_chat_fields(body))


def input_tokens(service: GatewayService, body: CountTokensRequest) -> int:
    """The prompt tokens of ``body`` as a request would be rendered (tokens)."""
    fields = _chat_fields(body)
    return len(chat_prompt_ids(service.tokenizer, fields["messages"], fields.get("tools")))


async def _collect(gen: Generation) -> tuple[str, list[int], link_pb2.Finished | None]:
    texts: list[str] = []
    ids: list[int] = []
    finished = None
    async for event in gen.events():
        if isinstance(event, link_pb2.Delta):
            texts.append(event.text)
            ids.extend(event.token_ids)
        else:
            finished = event
    return "".join(texts), ids, finished


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Answer:
    """Builds the ``message`` and the stream of one admitted request."""

    def __init__(self, service: GatewayService, gen: Generation, model: str,
                 reasoning: ReasoningFormat | None) -> None:
        self.service, self.gen, self.model, self.reasoning = service, gen, model, reasoning
        tools = gen.request.tools
        self.tools = tools if tools is not None and tools.parses_calls else None
        self.stops = tuple(gen.request.stop or ())
        ids = StableIds(gen.internal_id)  # the same on a gateway that resumes the stream
        self.stream = anth.MessageEvents(gen.request_id, model, self.tools, reasoning, lambda: ids("call"))
        #: The output so far (text pieces, token ids, tokens): what the stop sequence is
        #: matched on and where the ``id:`` lines count from.
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.offset = 0
        #: Closing events the client has (a resume at ``<offset>.<k>``: k), not sent again.
        self.seen = 0

    def stop_sequence(self, ids: list[int], text: str) -> str | None:
        """The request's ``stop_sequences`` entry that ended the output (``ids``, the generated
        token ids, whose ``text`` still holds it), or None when none did."""
        return anth.matched_stop(self.service.tokenizer_of(self.gen.request), ids, text, self.stops)

    async def whole(self, request: Request) -> Response:
        """The whole answer as one Anthropic ``message`` body (status 200), or status 499 when
        the client left first; the run is closed either way."""
        collect = asyncio.ensure_future(_collect(self.gen))
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return Response(status_code=CLIENT_CLOSED_STATUS)
            text, ids, finished = collect.result()
        finally:
            for task in (collect, disconnect):
                task.cancel()
            await self.gen.close()
        blocks, made_calls = anth.content_blocks(text, self.tools, self.reasoning)
        stop = self.stop_sequence(ids, text) if finished is not None else None
        reason = anth.stop_reason(finished.finish_reason, made_calls, stop)
        body = anth.message(self.gen.request_id, self.model, blocks, reason, stop, self.gen.usage)
        return JSONResponse(body, headers={"X-Request-Id": self.gen.request_id,
                                           **self.gen.rate_limit_headers})

    def restore(self, point: ResumePoint) -> None:
        """Rebuild the stream its client has at ``point`` (a ``Last-Event-ID`` resume): the
        start and the journaled pieces fed to the events' builder, nothing sent; the stream
        then sends what follows (gateway/rest/stream_rebuild.py).

        """
        self.stream.start(self.gen.request.prompt_tokens)
        for text, _tokens in point.pieces:
            self.stream.text(text)
        self.texts, self.ids, self.offset = [point.text], list(point.token_ids), point.offset
        self.seen = point.after

    def _group(self, frames: list[bytes]) -> bytes:
        """``frames`` as one write, each with the ``id:`` line of the tokens sent so far."""
        return b"".join(with_id(frame, self.gen.request_id, self.offset) for frame in frames)

    async def events(self) -> AsyncIterator[bytes]:
        """The answer as Anthropic's SSE events (``message_start`` .. ``message_stop``), UTF-8
        frames, each with its ``id:`` line (``<request id>/<output tokens so far>``; the closing
        ``content_block_stop`` .. ``message_stop`` ``<request id>/<offset>.<k>``); an error
        after the start is sent as an ``error`` event. A resumed stream (``gen.resumed``, after
        :meth:`restore`) sends only what follows the client's offset."""
        stream = self.stream
        try:
            if not self.gen.resumed:
                yield self._group(stream.start(self.gen.request.prompt_tokens))
            async for event in self.gen.events():
                if isinstance(event, link_pb2.Delta):
                    self.texts.append(event.text)
                    self.ids.extend(event.token_ids)
                    self.offset += len(event.token_ids)
                    frames = stream.text(event.text)
                    if frames:
                        yield self._group(frames)
                    continue
                text = "".join(self.texts)
                stop = self.stop_sequence(self.ids, text)
                reason = anth.stop_reason(event.finish_reason, stream.made_calls, stop)
                yield closing_frames(stream.finish(reason, stop, self.gen.usage.completion_tokens),
                                     self.gen.request_id, self.offset, self.seen)
        except InflightError as err:
            _, body, _ = anth.error_body(err)
            yield anth.sse_event("error", body)


def messages_router(service: GatewayService) -> APIRouter:
    """The routes ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` of ``service``."""
    router = APIRouter()
    parser = service.settings.reasoning_parser
    reasoning = reasoning_format(parser) if parser else None

    @router.post("/v1/messages", response_model=AnthropicMessage, responses={
        200: {"description": "The message (JSON), or with `stream: true` Anthropic's server-sent "
                             "events (`event: message_start` ... `event: message_stop`)",
              "content": {"text/event-stream": {"schema": {"type": "string"}}}},
        **_errors(*doc.GENERATION_ERRORS)})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        key = await service.admission.authenticate(authorization_of(request))
        resume = await resume_point_of(service, key, request, body.stream)
        try:
            gen = await service.submit(key, request_params(body), resume=resume, visible_id=visible_id(request))
        except InflightError as err:
            raise anth.anthropic_field_names(err) from None
        answer = _Answer(service, gen, gen.request.model, reasoning)
        if body.stream:
            if resume is not None:
                answer.restore(resume)
            await service.start_journal(gen, resume.created if resume is not None else int(time.time()), key)
            headers = {**SSE_HEADERS, "X-Request-Id": gen.request_id, **gen.rate_limit_headers}
            return GenerationStream(gen, answer.events(), headers, service.settings.stream_idle_timeout_s)
        try:
            return await answer.whole(request)
        except InflightError as err:  # after admission: the error carries the key's headers too
            err.headers.update(gen.rate_limit_headers)
            raise

    @router.post("/v1/messages/count_tokens", response_model=AnthropicTokenCount,
                 responses=_errors(400, 401, 404, 413, 429, 503))
    async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
        count, headers = await admit_unqueued(service, request, body.model, input_tokens, service, body)
        return JSONResponse({"input_tokens": count}, headers=headers)

    return router
