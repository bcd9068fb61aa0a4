"""Pydantic models of ``POST /v1/responses`` (OpenAI's Responses API) and its objects.

Field names and shapes follow OpenAI's API reference ("Responses"). As for chat, unknown
fields are ignored (clients send ``include``, ``prompt_cache_key``, ``reasoning``, ...),
known scalars take JSON's own types strictly, and the structured fields (``input``,
``tools``, ``tool_choice``, ``text``) are documented here but checked by
``gateway.rest.responses_input`` and the chat route's checks (``SkipValidation``), so
each error names its field the same way.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, StrictBool, StrictFloat, StrictInt


class InputTextPart(BaseModel):
    """A text content part of an input message (``input_text``; an earlier answer's
    ``output_text`` is read the same way)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """A message of ``input``: ``role`` and text ``content``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(BaseModel):
    """An earlier ``function_call`` of the model, sent back with its output."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """The result of the call ``call_id``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(BaseModel):
    """A function tool (Responses' flat form): ``name``, ``description``, ``parameters``
    (the JSON Schema of its arguments), ``strict``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    """``tool_choice`` forcing one function."""

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict``)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    """``text``: the output's format."""

    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class ResponseCreateRequest(BaseModel):
    """``POST /v1/responses`` body."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: SkipValidation[str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: StrictBool | None = None
    stream: StrictBool | None = False
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    tools: SkipValidation[list[FunctionTool] | None] = None
    tool_choice: SkipValidation[Literal["none", "auto", "required"] | FunctionToolChoice | None] = None
    parallel_tool_calls: SkipValidation[bool | None] = None
    text: SkipValidation[TextConfig | None] = None
    metadata: dict[str, str] | None = None
    # Read only to refuse them when they ask for something this server does not do
    # (gateway/rest/responses.py).
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    truncation: Any = None
    top_logprobs: Any = None


class ResponseUsage(BaseModel):
    """Token counts of a response (tokens)."""

    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A ``response`` object: ``output`` holds ``reasoning``, ``message`` and
    ``function_call`` items in the order the model wrote them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    store: bool
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(BaseModel):
    """``DELETE /v1/responses/{id}``'s answer."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
