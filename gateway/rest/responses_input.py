"""A ``POST /v1/responses`` body → the chat messages, tools and constraint the engine path
takes (the same validation, admission and queue as ``/v1/chat/completions``).

Shapes follow OpenAI's API reference ("Responses: create"):

* ``input``: a string (one user message) or a list of items: messages (``{"role",
  "content"}``, ``"type": "message"`` optional; ``content`` a string or ``input_text`` /
  ``output_text`` parts), ``function_call`` items (an earlier call of the model:
  ``call_id``, ``name``, ``arguments``) and ``function_call_output`` items (its result:
  ``call_id``, ``output``, whose ``call_id`` must name a ``function_call`` of the input or of
  the previous response, else a 400 on ``input`` as OpenAI's); ``reasoning`` items are accepted and left out of the prompt
  (templates drop earlier thinking).
* ``instructions``: a system message put first; not carried over to a later response
  that names this one in ``previous_response_id`` (as OpenAI).
* ``tools``: function tools in the flat form ``{"type": "function", "name",
  "description", "parameters", "strict"}``; ``tool_choice`` ``"none"``/``"auto"``/
  ``"required"`` or ``{"type": "function", "name"}``.
* ``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
  "json_schema", "name", "schema", "strict"}`` (chat's ``response_format`` by another shape).

Every refusal is an :class:`InvalidRequestError` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.errors import InvalidRequestError

#: The roles an input message may have (OpenAI's EasyInputMessage and Message).
ROLES = ("user", "system", "developer", "assistant")
#: Content part types read as text.
TEXT_PARTS = ("input_text", "output_text", "text")


def _unsupported(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="unsupported_parameter")


def _text(content: Any, where: str) -> str:
    """A message's ``content`` as text (string, or text parts joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"'{where}' must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            if kind in ("input_image", "input_file", "input_audio"):
                raise _unsupported(f"{where}[{j}]", f"'{where}[{j}]': {kind} is not supported by this "
                                                    "server (text only)")
            raise InvalidRequestError(f"'{where}[{j}]' must be {{\"type\": \"input_text\", \"text\": ...}}",
                                      param=f"{where}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"'{where}.{name}' must be a string", param=f"{where}.{name}")
    return value


def input_messages(value: Any, history: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """``input`` as chat messages (``{"role", "content"}``, assistant ``tool_calls``, tool
    ``tool_call_id``): consecutive ``function_call`` items join one assistant message (the
    one right before them when it is the assistant's). ``history``: the previous response's
    messages (``previous_response_id``), whose tool calls a ``function_call_output`` may answer.

    Raises:
        InvalidRequestError: a missing or malformed ``input``, an unknown item type,
            non-text content (naming ``input[i]...``); a ``function_call_output`` whose
            ``call_id`` matches no ``function_call`` of the input or of ``history`` (OpenAI's
            400 "No tool call found for function call output with call_id ...", on ``input``).
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("'input' must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequestError(f"'{where}.role' must be one of {list(ROLES)}, got {role!r}",
                                          param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise _unsupported(f"{where}.type", f"'{where}.type' {kind!r} is not supported by this server "
                                                "(message, function_call, function_call_output, reasoning)")
    if not out:
        raise InvalidRequestError("'input' holds no message", param="input")
    _check_call_ids(out, history)
    return out


def _check_call_ids(messages: list[dict[str, Any]], history: Sequence[dict[str, Any]]) -> None:
    """Every tool message of ``messages`` answers a tool call of ``messages`` or ``history``.

    Raises:
        InvalidRequestError: param ``input``, OpenAI's message.
    """
    calls = {call.get("id") for message in [*history, *messages] for call in message.get("tool_calls") or ()}
    for message in messages:
        if message["role"] == "tool" and message["tool_call_id"] not in calls:
            raise InvalidRequestError("No tool call found for function call output with call_id "
                                      f"{message['tool_call_id']}.", param="input")


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat ``tools`` (``{"type": "function", "function":
    {...}}``), for ``gateway.tools.spec.check_tools`` to check in depth.

    Raises:
        InvalidRequestError: not a list, a tool that is not an object, a tool type other
            than ``function`` (built-in tools are OpenAI's hosted ones).
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("'tools' must be a list of tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"'tools[{i}]' must be an object", param=f"tools[{i}]")
        if tool.get("type") != "function":
            raise _unsupported(f"tools[{i}].type", f"'tools[{i}].type' {tool.get('type')!r} is not supported "
                                                   "by this server (only function tools)")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' ``tool_choice`` as chat's (``{"type": "function", "name"}`` becomes
    ``{"type": "function", "function": {"name"}}``); other values pass for the tool checks."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: Any) -> Any:
    """``text.format`` as chat's ``response_format`` (None when absent or ``text``).

    Raises:
        InvalidRequestError: ``text`` or ``text.format`` not an object.
    """
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("'text.format' must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return fmt
