"""Pydantic models of the OpenAI request and response bodies we serve.

Field names and shapes follow the OpenAI API reference ("Completions", "Chat",
"Models"). Requests ignore unknown fields (clients send extras such as
``user`` or penalties); known fields take JSON's own types strictly, as OpenAI
does (``"max_tokens": "10"`` or ``10.0`` is a 400, not a silent coercion); ranges are checked by ``gateway.admission.validation``, not here,
so that every range error names its parameter the same way for REST and gRPC.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, SkipValidation, StrictBool,
                      StrictFloat, StrictInt, WithJsonSchema, create_model, model_serializer)

from common.sampling import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, PARAMS


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final usage-only chunk;
    ``continuous_usage_stats`` (vLLM) with it puts the usage so far on every chunk."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _RequestFields(BaseModel):
    """The first fields of a generation request (max_tokens in tokens)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: StrictInt | None = None


#: The scalar sampling parameters of ``common.sampling.PARAMS`` (temperature, top_p, the
#: penalties, ...): JSON's own type strictly; their ranges are checked by validation (the
#: schema documents those the table gives; pydantic does not enforce them, so every range
#: error reads the same over REST and gRPC).
_ScalarSamplingFields = create_model(
    "_ScalarSamplingFields", __base__=_RequestFields,
    **{p.name: (Optional[StrictInt] if p.is_integer else Optional[StrictFloat],
                Field(None, json_schema_extra=p.json_schema)) for p in PARAMS})


class _SamplingFields(_ScalarSamplingFields):
    """Fields shared by completions and chat."""

    stop: str | list[str] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    priority: StrictInt | None = None  # inflight extension: ask for a lower priority class
    # vLLM extensions (vLLM "Extra parameters" of its OpenAI server); types checked by validation.
    stop_token_ids: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    logit_bias: Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [{
        "type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES, "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -int(MAX_LOGIT_BIAS), "maximum": int(MAX_LOGIT_BIAS)}},
        {"type": "null"}], "description": "token id (decimal string) -> bias added to its logit"})] = None
    # Structured outputs (gateway/admission/structured.py checks the shapes): OpenAI's
    # response_format, vLLM's structured_outputs and its older guided_* extra parameters.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # Read only to refuse them (gateway/rest/unsupported.py).
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    use_beam_search: Any = None  # vLLM extension
    length_penalty: Any = None  # vLLM extension


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body."""

    prompt: str | list[str] | list[int] | None = None
    logprobs: StrictInt | None = None  # top alternatives per token (OpenAI allows 0..5)


class TextContentPart(BaseModel):
    """A text content part, ``{"type": "text", "text": ...}`` (the only kind served)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


MessageContent = str | list[TextContentPart]


class SystemMessageParam(BaseModel):
    """A ``system`` message."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system"]
    content: MessageContent
    name: str | None = None


class DeveloperMessageParam(BaseModel):
    """A ``developer`` message (OpenAI's newer name for ``system``; rendered as one)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["developer"]
    content: MessageContent
    name: str | None = None


class UserMessageParam(BaseModel):
    """A ``user`` message."""

    model_config = ConfigDict(extra="allow")
    role: Literal["user"]
    content: MessageContent
    name: str | None = None


class FunctionCallParam(BaseModel):
    """The function of an earlier tool call: its ``name`` and ``arguments`` (JSON text)."""

    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCallParam(BaseModel):
    """A tool call of an earlier assistant turn, as this server (or OpenAI) returned it."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class AssistantMessageParam(BaseModel):
    """An earlier ``assistant`` turn; its ``content`` may be null or absent (with ``tool_calls``)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["assistant"]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None


class ToolMessageParam(BaseModel):
    """A ``tool`` result message: the result of the call ``tool_call_id``."""

    model_config = ConfigDict(extra="allow")
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str | None = None


class FunctionDefinition(BaseModel):
    """A tool's function: ``name`` (1 to 64 of ``a-zA-Z0-9_-``), ``description``, and
    ``parameters``, the JSON Schema of its arguments (an object schema)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(BaseModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    """The function a ``tool_choice`` object names."""

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` forcing one function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"]
    function: NamedFunction


ChatMessageParam = Annotated[
    SystemMessageParam | DeveloperMessageParam | UserMessageParam | AssistantMessageParam
    | ToolMessageParam, Field(discriminator="role")]


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body. ``messages`` is documented as the union by role
    but checked by ``gateway.prompts`` (``SkipValidation``), so that a bad message gets the
    same error, naming ``messages[i].role`` or ``messages[i].content``, over REST and gRPC."""

    messages: SkipValidation[list[ChatMessageParam]]
    max_completion_tokens: StrictInt | None = None
    # Checked by gateway.tools.spec (SkipValidation: the errors name the field the same way
    # over REST and gRPC); the models document the shapes.
    tools: SkipValidation[list[ToolParam] | None] = None
    tool_choice: SkipValidation[Literal["none", "auto", "required"] | NamedToolChoice | None] = None
    parallel_tool_calls: SkipValidation[bool | None] = None
    functions: Any = None  # legacy: refused (gateway/rest/unsupported.py)
    function_call: Any = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    # vLLM extension: more chat-template variables (gateway/template_kwargs.py checks them).
    chat_template_kwargs: SkipValidation[dict[str, Any] | None] = None


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens served from the
    worker's prefix cache."""

    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """``usage.completion_tokens_details``: ``reasoning_tokens``, the completion tokens spent
    inside a ``<think>`` block (with the server's ``--reasoning-parser``; common/reasoning.py)."""

    reasoning_tokens: int = 0


class Usage(BaseModel):
    """Token counts (tokens)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler: SerializerFunctionWrapHandler):  # noqa: ANN202
        """No ``completion_tokens_details`` key at all when there are none (a server without
        ``--reasoning-parser``), as before they existed. (No return annotation: with one,
        pydantic would document Usage as any object in /openapi.json.)"""
        out = handler(self)
        if out.get("completion_tokens_details", 0) is None:
            del out["completion_tokens_details"]
        return out


class CompletionChoice(BaseModel):
    """One completion choice (``index`` 0 to n - 1)."""

    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    """``text_completion`` response."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class FunctionCall(BaseModel):
    """A called function: ``name`` and ``arguments``, a JSON text (parse it)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of a generated message (``id`` ``call_…``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The generated chat message: ``content`` (null when the message is only tool calls),
    ``tool_calls``, present only when the model called tools (docs/TOOLS.md), and
    ``reasoning_content`` (vLLM's field), present only when the server's
    ``--reasoning-parser`` found thinking (docs/API.md)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_calls(self, handler: Any):  # noqa: ANN202 - annotated, /openapi.json would show any object
        """OpenAI leaves ``tool_calls`` out of a message without calls (not ``null``);
        ``reasoning_content`` likewise."""
        data = handler(self)
        for name in ("tool_calls", "reasoning_content"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


#: Why a choice ended: EOS or a stop sequence, ``max_tokens``, or (with tools) tool calls.
FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    """One chat choice (``index`` 0 to n - 1)."""

    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    """``chat.completion`` response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class FunctionCallDelta(BaseModel):
    """A streamed piece of a call's function: ``name`` on its first delta, then
    ``arguments`` fragments (concatenated they are the arguments' JSON text)."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of tool call ``index``: ``id``, ``type`` and the function's name
    on its first delta only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    """Incremental message content of a stream chunk: ``role`` (and ``content: ""``) on the
    first chunk only, ``content``, ``reasoning_content`` or ``tool_calls`` on the others,
    none on the finish chunk (absent, not null)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a stream chunk."""

    index: int = 0
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """``chat.completion.chunk`` (SSE); built by ``gateway.rest.openai_format.chat_chunk``,
    ``usage`` present only with ``stream_options.include_usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    """OpenAI streams completions as ``text_completion`` objects too."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models`` (OpenAI's fields, then vLLM's extensions)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "inflight"
    root: str | None = None  # vLLM: the model an alias or adapter runs on
    parent: str | None = None  # vLLM: a LoRA adapter's base model; None otherwise
    max_model_len: int | None = None  # vLLM: the context length in tokens
    context_length: int | None = None  # the same, under the name this API used first
    scale_from_zero: bool = False  # configured, no ready worker now (one starts on demand)
    task: str = "generate"  # "generate" or "embed"


def model_card(entry: Any) -> ModelCard:
    """The card of a ``gateway.model_registry.ModelEntry``."""
    return ModelCard(id=entry.id, created=entry.created, root=entry.root or None, parent=entry.parent or None,
                     max_model_len=entry.max_model_len, context_length=entry.max_model_len,
                     scale_from_zero=entry.scale_from_zero, task=entry.task)


class ModelList(BaseModel):
    """``GET /v1/models`` response."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    """The inner object of OpenAI's error body (``gateway.errors.error_body``)."""

    message: str
    type: str = Field(examples=["invalid_request_error"])
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail
