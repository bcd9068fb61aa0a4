"""A request's ``tools`` and ``tool_choice``, checked into one :class:`ToolSpec` (the
legacy ``functions``/``function_call`` stay refused: ``gateway/rest/unsupported.py``).

Shapes and limits follow OpenAI's API reference ("Create chat completion": ``tools``,
``tool_choice``): a tool is ``{"type": "function",
"function": {"name", "description"?, "parameters"?, "strict"?}}``, a name is 1 to 64
of ``a-z A-Z 0-9 _ -``, at most 128 tools; ``parameters`` is a JSON Schema object
(checked against its metaschema with ``jsonschema``, draft 2020-12 unless ``$schema``
names another). ``tool_choice`` is ``"none"``, ``"auto"``, ``"required"`` or
``{"type": "function", "function": {"name": ...}}`` naming one of the tools. Every
error is an :class:`InvalidRequestError` naming the parameter at fault.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jsonschema
from jsonschema.exceptions import SchemaError

from gateway.admission.closed_schema import close_schema
from gateway.errors import InvalidRequestError
from gateway.tools.parser import ToolCallStream

MAX_TOOLS = 128  # OpenAI's limit on ``tools``
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
CHOICES = ("none", "auto", "required")
#: ``parameters`` when a function declares none (OpenAI: "omitting parameters defines a
#: function with an empty parameter list").
NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFunction:
    """One callable function.

    Attributes:
        name: the function's name (1 to 64 of ``A-Za-z0-9_-``).
        description: what it does, for the model ("" when not given).
        parameters: its arguments' JSON Schema (an object schema).
        strict: OpenAI's ``strict``: an enforced call's arguments have every property and
            no other (``gateway.admission.closed_schema``).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    strict: bool = False

    def openai_tool(self) -> dict:
        """The ``{"type": "function", "function": {...}}`` form (what chat templates get)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSpec:
    """The tools of one chat request and how the model may use them.

    Attributes:
        functions: the tools, in the request's order (at least one).
        choice: ``"none"`` (no call: tools left out of the prompt, output is text),
            ``"auto"`` (the model decides; what it writes is parsed), ``"required"`` (at
            least one call) or ``"function"`` (a call of :attr:`forced`).
        forced: the function ``tool_choice`` names, else None.
    """

    functions: tuple[ToolFunction, ...]
    choice: str = "auto"
    forced: str | None = None

    @property
    def names(self) -> frozenset[str]:
        """The functions' names."""
        return frozenset(f.name for f in self.functions)

    @property
    def parses_calls(self) -> bool:
        """Whether the output is parsed for calls (every choice but ``none``)."""
        return self.choice != "none"

    @property
    def must_call(self) -> bool:
        """``required`` or a named function: the output must be a call."""
        return self.choice in ("required", "function")

    def stream(self, call_ids: Callable[[], str] | None = None) -> ToolCallStream:
        """A fresh incremental parser of one choice's output for these tools (arguments
        streamed as written when the call is grammar-enforced); ``call_ids`` makes the calls'
        ids (None: random ones)."""
        if call_ids is None:
            return ToolCallStream(self.names, incremental=self.must_call)
        return ToolCallStream(self.names, incremental=self.must_call, call_ids=call_ids)

    def callable(self) -> tuple[ToolFunction, ...]:
        """The functions the model may call: the forced one, or all of them."""
        if self.forced is not None:
            return tuple(f for f in self.functions if f.name == self.forced)
        return self.functions


def check_tools(tools: Any, tool_choice: Any) -> ToolSpec | None:
    """The request's :class:`ToolSpec`, or None when it has no tools (absent or empty).

    Args:
        tools: the request's ``tools``.
        tool_choice: its ``tool_choice`` (absent: ``"auto"`` with tools, as OpenAI).

    Raises:
        InvalidRequestError: a malformed tool, a duplicate name, an invalid ``parameters``
            schema, an unknown ``tool_choice``, a choice naming no tool, or a
            ``tool_choice`` other than ``"none"`` without tools.
    """
    if tools is None or (isinstance(tools, list) and not tools):
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("'tool_choice' is only allowed when 'tools' are given",
                                      param="tool_choice")
        return None
    checked = _check_list(tools, "tools")
    choice, forced = _check_choice(tool_choice, {f.name for f in checked}, "tool_choice")
    return ToolSpec(functions=checked, choice=choice, forced=forced)


def _check_list(tools: Any, param: str) -> tuple[ToolFunction, ...]:
    if not isinstance(tools, list):
        raise InvalidRequestError(f"'{param}' must be a list of tools", param=param)
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"'{param}' holds {len(tools)} tools; at most {MAX_TOOLS}",
                                  param=param)
    out: list[ToolFunction] = []
    for i, tool in enumerate(tools):
        function = _check_tool(tool, f"{param}[{i}]")
        if any(f.name == function.name for f in out):
            raise InvalidRequestError(f"{param}[{i}]: the function name {function.name!r} is "
                                      "used twice", param=f"{param}[{i}].function.name")
        out.append(function)
    return tuple(out)


def _check_tool(tool: Any, where: str) -> ToolFunction:
    if not isinstance(tool, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where)
    if tool.get("type") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function', got {tool.get('type')!r}",
                                  param=f"{where}.type")
    return check_function(tool.get("function"), f"{where}.function")


def check_function(function: Any, where: str) -> ToolFunction:
    """One function object (``name``, ``description``?, ``parameters``?, ``strict``?).

    Raises:
        InvalidRequestError: naming ``where`` (e.g. ``tools[0].function``) and the field.
    """
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where)
    name = function.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidRequestError(f"{where}.name must be 1 to 64 characters of a-z, A-Z, 0-9, "
                                  f"'_' and '-', got {name!r}", param=f"{where}.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description must be a string",
                                  param=f"{where}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.strict must be a boolean", param=f"{where}.strict")
    parameters = function.get("parameters")
    parameters = NO_PARAMETERS if parameters is None else _check_parameters(parameters, where)
    try:
        close_schema(parameters, bool(strict), f"{where}.parameters")  # refuses what strict cannot close
    except RecursionError:
        raise InvalidRequestError(f"{where}.parameters nests too deeply", param=f"{where}.parameters") from None
    return ToolFunction(name=name, description=description or "", parameters=parameters,
                        strict=bool(strict))


def _check_parameters(schema: Any, where: str) -> Mapping[str, Any]:
    param = f"{where}.parameters"
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON Schema object", param=param)
    if schema.get("type", "object") != "object":
        raise InvalidRequestError(f"{param} must describe an object (\"type\": \"object\"): "
                                  "arguments are a JSON object", param=param)
    try:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequestError(f"{param} is not a valid JSON Schema: {exc.message}",
                                  param=param) from exc
    except (RecursionError, ValueError, TypeError) as exc:  # deep nesting, odd numbers
        raise InvalidRequestError(f"{param} could not be checked as a JSON Schema: {exc}",
                                  param=param) from exc
    try:
        json.dumps(schema, allow_nan=False)
    except ValueError as exc:
        raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from exc
    return schema


def _check_choice(choice: Any, names: set[str], param: str) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise InvalidRequestError(f"'{param}' must be one of {list(CHOICES)} or a function "
                                      f"object, got {choice!r}", param=param)
        return choice, None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"'{param}' as an object must be {{\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}}", param=param)
        name = function.get("name")
        if name not in names:
            raise InvalidRequestError(f"'{param}' names the function {name!r}, which is not among "
                                      f"the tools {sorted(names)}", param=param)
        return "function", name
    raise InvalidRequestError(f"'{param}' must be a string or an object", param=param)
