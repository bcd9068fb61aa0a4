"""Anthropic's Messages API (``POST /v1/messages``) onto the chat path, and its answers.

Requests (shapes from Anthropic's API reference, "Messages"): ``system`` (a string or text
blocks) becomes the first system message; a message's ``content`` is a string or blocks:
``text``, ``tool_use`` (an assistant's earlier call: ``id``, ``name``, ``input``) and
``tool_result`` (a user turn's ``tool_use_id`` and ``content``, a string or text blocks;
``is_error`` marks it), turned into OpenAI chat messages (assistant ``tool_calls``, ``tool``
messages) so that ``gateway.prompts`` and ``gateway.tools`` render and check them as for
chat completions. ``tools`` (``name``, ``description``, ``input_schema``) and
``tool_choice`` (``auto``, ``any``, ``tool`` with ``name``, ``none``;
``disable_parallel_tool_use``) map onto OpenAI's ``tools``/``tool_choice``/
``parallel_tool_calls``; ``stop_sequences`` is ``stop``. Thinking blocks in history are
dropped; images, documents, server tools and a final assistant turn (prefill) are refused (400).

Answers: a ``message`` object whose ``content`` holds, with the server's
``--reasoning-parser``, the model's thinking as a ``thinking`` block, then a ``text`` block and ``tool_use``
blocks (ids ``toolu_…``), ``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence``
(with the sequence) or ``tool_use``, and ``usage`` (``input_tokens`` not read from the
prefix cache, ``cache_read_input_tokens``, ``output_tokens``); streams as Anthropic's
events (:class:`MessageEvents`). Errors are ``{"type": "error", "error": {"type",
"message"}}`` (:func:`error_body`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from common.reasoning import ReasoningFormat, ReasoningSplitter, split_reasoning
from gateway.errors import InflightError, InvalidRequestError, http_error
from gateway.tools.parser import CallDelta, Emitted, ToolCallStream, parse_tool_calls
from gateway.tools.spec import ToolSpec
from protos import common_pb2

#: Anthropic's error ``type`` by HTTP status (its API reference, "Errors").
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 504: "api_error"}


def error_body(err: InflightError) -> tuple[int, dict, dict[str, str]]:
    """``(status, body, headers)`` of ``err`` in Anthropic's error shape; the status and
    headers (``Retry-After``, rate limits) are the OpenAI fronts' (``gateway.errors``)."""
    status, body, headers = http_error(err)
    return status, {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                               "message": body["error"]["message"]}}, headers


#: Chat's names of a tool's fields → Anthropic's (``tools[i].function.parameters`` is
#: ``tools[i].input_schema``).
_CHAT_TOOL_FIELD = re.compile(r"\btools\[(\d+)\]\.function(\.parameters\b)?")


def _tool_field(found: re.Match) -> str:
    return f"tools[{found.group(1)}]" + (".input_schema" if found.group(2) else "")


def anthropic_field_names(err: InflightError) -> InflightError:
    """``err``, raised by the chat path that serves ``/v1/messages``, with Anthropic's field
    names in its ``param`` and message (the message is what Anthropic's error body shows):
    ``stop_sequences`` for chat's ``stop``, ``tools[i].name`` / ``tools[i].input_schema``
    for chat's ``tools[i].function.name`` / ``.parameters``. A client otherwise hears of
    fields it never sent."""
    param = err.param or ""
    if param == "stop":
        err.param = "stop_sequences"
        err.message = err.message.replace("'stop'", "'stop_sequences'")
    elif _CHAT_TOOL_FIELD.search(param):
        err.param = _CHAT_TOOL_FIELD.sub(_tool_field, param)
        err.message = _CHAT_TOOL_FIELD.sub(_tool_field, err.message)
    return err


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def _text_of(blocks: Any, param: str) -> str:
    """The text of a string or a list of ``text`` blocks (raises naming ``param``)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad("must be a string or a list of text blocks", param)
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _bad("only text blocks are supported here", f"{param}[{j}]")
        parts.append(block["text"])
    return "".join(parts)


def chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages for Anthropic's ``system`` and ``messages`` (see the module
    docstring).

    Raises:
        InvalidRequestError: a malformed message or block, naming ``messages[i].content[j]``.
    """
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise _bad("must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _bad("must be an object with role 'user' or 'assistant'", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out += _blocks(message["role"], content, f"{where}.content")
        else:
            raise _bad("must be a string or a list of content blocks", f"{where}.content")
    if messages[-1].get("role") == "assistant":
        raise _bad("a final assistant turn (prefilling the answer) is not supported; end with a "
                   "user turn", f"messages[{len(messages) - 1}].role")
    return out


def _blocks(role: str, blocks: list, where: str) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not part of the prompt
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        else:
            raise _bad(f"a {role} message may hold text{', tool_use' if role == 'assistant' else ', tool_result'}"
                       f" blocks, got {kind!r}", at)
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        return [message]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tool_use(block: dict, at: str) -> dict[str, Any]:
    name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
        raise _bad("a tool_use block needs a string 'id', a string 'name' and an object 'input'", at)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_result(block: dict, at: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise _bad("a tool_result block needs a string 'tool_use_id'", at)
    content = block.get("content", "")
    text = _text_of(content, f"{at}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def openai_tools(tools: Any, tool_choice: Any) -> tuple[Any, Any, bool | None]:
    """``(tools, tool_choice, parallel_tool_calls)`` in OpenAI's shapes, for
    ``gateway.tools.request.tool_fields`` to check.

    Raises:
        InvalidRequestError: a tool that is not a custom tool (``input_schema``), a
            malformed ``tool_choice``.
    """
    converted = None
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("must be a list of tools", "tools")
        converted = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
                raise _bad("only custom tools (name, description, input_schema) are supported",
                           f"tools[{i}]")
            function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            converted.append({"type": "function", "function": function})
    if tool_choice is None:
        return converted, None, None
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    parallel = tool_choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use")
    choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return converted, choice, (None if parallel is None else not parallel)


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_…`` id for the parser's ``call_…`` id."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish: int, made_calls: bool, stop_sequence: str | None) -> str:
    """Anthropic's ``stop_reason`` of a finished choice."""
    if finish == common_pb2.FINISH_REASON_LENGTH:
        return "max_tokens"
    if made_calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(tokenizer: Any, token_ids: list[int], text: str, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended the output, or None (it ended at EOS, a stop token or
    its length). The worker leaves the stop string out of the text but not out of the
    tokens, so the tokens' text goes on with it after the output's text."""
    if not stops or not token_ids:
        return None
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    rest = full[len(text):] if full.startswith(text) else full
    return next((s for s in stops if s in rest), None)


def usage(u: common_pb2.Usage) -> dict[str, int]:
    """Anthropic's ``usage``: ``input_tokens`` excludes the prompt tokens read from the
    prefix cache (``cache_read_input_tokens``), as Anthropic counts them."""
    return {"input_tokens": u.prompt_tokens - u.cached_prompt_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_prompt_tokens,
            "output_tokens": u.completion_tokens}


def thinking_block(thinking: str) -> dict:
    """A ``thinking`` block (``signature`` empty: this server signs nothing)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def content_blocks(text: str, tools: ToolSpec | None,
                   reasoning: ReasoningFormat | None = None) -> tuple[list[dict], bool]:
    """``(content blocks, made calls)`` of a whole output: with ``reasoning`` (the server's
    ``--reasoning-parser``) its thinking as a ``thinking`` block first, then its text, and
    with tools its parsed calls as ``tool_use`` blocks (a call cut before its arguments
    closed stays text)."""
    blocks: list[dict] = []
    if reasoning is not None:
        split = split_reasoning(text, reasoning)
        text = split.content
        if split.reasoning:
            blocks.append(thinking_block(split.reasoning))
    if tools is None:
        return blocks + ([{"type": "text", "text": text}] if text else []), False
    parsed = parse_tool_calls(text, tools.names, incremental=tools.must_call)
    blocks += [{"type": "text", "text": parsed.content}] if parsed.content else []
    made = False
    for call in parsed.calls:
        try:
            arguments = json.loads(call.arguments)
        except (ValueError, RecursionError):
            arguments = None
        if isinstance(arguments, dict):
            blocks.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                           "input": arguments})
            made = True
        else:
            blocks.append({"type": "text", "text": call.arguments})
    return blocks, made


def message(rid: str, model: str, blocks: list[dict], reason: str, stop_sequence: str | None,
            u: common_pb2.Usage) -> dict:
    """The ``message`` object of a finished request."""
    return {"id": f"msg_{rid}", "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": usage(u)}


def sse_event(kind: str, data: dict) -> bytes:
    """One server-sent event as Anthropic sends it: ``event: <type>`` and ``data: <json>``."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class MessageEvents:
    """The stream of one request as Anthropic's events: ``message_start``, ``ping``, then
    per content block ``content_block_start``, its ``content_block_delta``s (``text_delta``
    or ``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason,
    output tokens) and ``message_stop``.

    Args:
        rid: the request id (``msg_<rid>``).
        model: the served model.
        tools: the request's tools when its output is parsed for calls, else None.
        reasoning: the server's ``--reasoning-parser`` format: the thinking streams first as a
            ``thinking`` block (``thinking_delta``); None: no reasoning parser.
        call_ids: makes the calls' ids (``call_…``, shown as ``toolu_…``); None: random. A
            resumable stream's derive from the stream (gateway/rest/stream_rebuild.py).
    """

    def __init__(self, rid: str, model: str, tools: ToolSpec | None,
                 reasoning: ReasoningFormat | None = None, call_ids: Callable[[], str] | None = None) -> None:
        self._rid, self._model = rid, model
        self._parser: ToolCallStream | None = tools.stream(call_ids) if tools is not None else None
        self._splitter = ReasoningSplitter(reasoning) if reasoning is not None else None
        self._index = -1
        self._open: str | None = None  # "thinking", "text" or "tool_use"
        self.made_calls = False

    def start(self, prompt_tokens: int) -> list[bytes]:
        """``message_start`` (usage so far: the prompt) and a ``ping``."""
        u = common_pb2.Usage(prompt_tokens=prompt_tokens)
        shell = message(self._rid, self._model, [], None, None, u)  # type: ignore[arg-type]
        return [sse_event("message_start", {"type": "message_start", "message": shell}),
                sse_event("ping", {"type": "ping"})]

    def text(self, text: str) -> list[bytes]:
        """The events of one delta of output text."""
        if self._splitter is None:
            return self._answer(text)
        split = self._splitter.feed(text)
        return self._thinking(split.reasoning) + self._answer(split.content)

    def _answer(self, text: str) -> list[bytes]:
        if self._parser is None:
            return self._text(text) if text else []
        return self._emitted(self._parser.feed(text))

    def _thinking(self, thinking: str) -> list[bytes]:
        if not thinking:
            return []
        out = [] if self._open == "thinking" else self._open_block(thinking_block(""), "thinking")
        return out + [self._delta({"type": "thinking_delta", "thinking": thinking})]

    def finish(self, reason: str, stop_sequence: str | None, output_tokens: int) -> list[bytes]:
        """What the splitter and the parser held back, the last block's stop,
        ``message_delta`` and ``message_stop``."""
        out: list[bytes] = []
        if self._splitter is not None:
            held = self._splitter.finish()
            out += self._thinking(held.reasoning) + self._answer(held.content)
        out += self._emitted(self._parser.finish()) if self._parser is not None else []
        out += self._close()
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                 "usage": {"output_tokens": output_tokens}}
        return out + [sse_event("message_delta", delta),
                      sse_event("message_stop", {"type": "message_stop"})]

    def _emitted(self, emitted: Emitted) -> list[bytes]:
        out = self._text(emitted.content) if emitted.content else []
        for delta in emitted.calls:
            out += self._call(delta)
        return out

    def _text(self, text: str) -> list[bytes]:
        out = [] if self._open == "text" else self._open_block({"type": "text", "text": ""}, "text")
        return out + [self._delta({"type": "text_delta", "text": text})]

    def _call(self, delta: CallDelta) -> list[bytes]:
        out: list[bytes] = []
        if delta.id is not None:
            self.made_calls = True
            out += self._open_block({"type": "tool_use", "id": tool_use_id(delta.id), "name": delta.name,
                                     "input": {}}, "tool_use")
        if delta.arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": delta.arguments}))
        return out

    def _open_block(self, block: dict, kind: str) -> list[bytes]:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + [sse_event("content_block_start", {"type": "content_block_start",
                                                        "index": self._index, "content_block": block})]

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                 "delta": delta})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})]
