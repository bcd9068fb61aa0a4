"""Tools and tool-call history into the chat template's input (docs/TOOLS.md).

A model whose chat template takes ``tools`` (its Jinja source reads that variable, as
Qwen2.5's, Llama 3.1's and Hermes 2 Pro's do) gets them as the template expects, in
Hugging Face's convention: ``tools`` is a list of ``{"type": "function", "function":
{...}}``, an assistant message carries ``tool_calls`` with ``arguments`` as an object,
a tool message its ``tool_call_id``. Any other model (SmolLM2-135M-Instruct's template
renders roles and contents only) gets the Hermes-style format that vLLM's ``hermes``
parser reads, written into the messages themselves:

* a system section listing each function's JSON schema between ``<tools>`` and
  ``</tools>`` and asking for ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (appended to the first system message, or a new first system message);
* an earlier assistant turn's ``tool_calls`` as ``<tool_call>`` blocks in its content;
* a ``tool`` message's content inside ``<tool_response>`` and ``</tool_response>``.

With ``tool_choice: "none"`` the tools are left out of the prompt (the model is not
offered them; history is still rendered). Everything the Hermes format adds is message
content, so the special-token guard of ``Tokenizer.encode_chat`` covers it.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.tools.spec import ToolSpec

TOOLS_INTRO = ("# Tools\n\nYou can call functions to help with the user's request. Each function "
               "is described by a JSON schema between <tools> and </tools>:\n<tools>\n")
TOOLS_OUTRO = ("\n</tools>\n\nTo call a function, write a JSON object with its name and its "
               "arguments between <tool_call> and </tool_call>, one block per call:\n"
               "<tool_call>\n{\"name\": \"<function name>\", \"arguments\": "
               "<the arguments as a JSON object>}\n</tool_call>")


def tools_section(spec: ToolSpec) -> str:
    """The system-prompt section of the Hermes format for ``spec`` (its choice included)."""
    listed = "\n".join(json.dumps(f.openai_tool(), ensure_ascii=False) for f in spec.functions)
    text = TOOLS_INTRO + listed + TOOLS_OUTRO
    if spec.forced is not None:
        text += f"\n\nAnswer with a call of the function {spec.forced}."
    elif spec.choice == "required":
        text += "\n\nAnswer with at least one function call."
    return text


def takes_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template renders ``tools`` itself."""
    return bool(getattr(tokenizer, "chat_template_takes_tools", False))


def render_inputs(tokenizer: Any, messages: list[dict], spec: ToolSpec | None,
                  ) -> tuple[list[dict], dict[str, Any]]:
    """``(messages, template variables)`` for the chat template: the native form when
    the template takes tools, else the Hermes form (module docstring). ``messages``
    are :func:`gateway.prompts.normalize_messages`' output.

    Raises:
        InvalidRequestError: (native form) a tool or a call's arguments hold a special
            token's text, which the template would emit as that token.
    """
    offered = spec if spec is not None and spec.choice != "none" else None
    if takes_tools(tokenizer):
        return _native(tokenizer, messages, offered)
    return _hermes(messages, offered), {}


def _native(tokenizer: Any, messages: list[dict], spec: ToolSpec | None
            ) -> tuple[list[dict], dict[str, Any]]:
    out = []
    for msg in messages:
        if "tool_calls" in msg:
            calls = [{**c, "function": {**c["function"],
                                        "arguments": _arguments_value(c["function"]["arguments"])}}
                     for c in msg["tool_calls"]]
            msg = {**msg, "tool_calls": calls}
            _refuse_special_tokens(tokenizer, calls, "messages")
        out.append(msg)
    if spec is None:
        return out, {}
    tools = [f.openai_tool() for f in spec.functions]
    _refuse_special_tokens(tokenizer, tools, "tools")
    return out, {"tools": tools}


def _hermes(messages: list[dict], spec: ToolSpec | None) -> list[dict]:
    out = []
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            blocks = "\n".join(_call_block(c["function"]) for c in msg["tool_calls"])
            content = f"{msg['content'].strip()}\n{blocks}" if msg["content"].strip() else blocks
            msg = {"role": "assistant", "content": content}
        elif msg["role"] == "tool":
            msg = {"role": "tool", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
        else:
            msg = {k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id")}
        out.append(msg)
    if spec is None:
        return out
    section = tools_section(spec)
    if out and out[0]["role"] == "system":
        first = out[0]["content"]
        return [{**out[0], "content": f"{first}\n\n{section}" if first else section}, *out[1:]]
    return [{"role": "system", "content": section}, *out]


def _call_block(function: dict) -> str:
    call = {"name": function["name"], "arguments": _arguments_value(function["arguments"])}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def _arguments_value(arguments: str) -> Any:
    """A call's ``arguments`` string as the JSON value it holds (the string itself when
    it is not JSON: OpenAI does not check it either)."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


def _refuse_special_tokens(tokenizer: Any, value: Any, param: str) -> None:
    special = getattr(tokenizer, "special_tokens_in", None)
    if special is None:
        return
    found = special(tokenizer.encode(json.dumps(value, ensure_ascii=False)))
    if found:
        raise InvalidRequestError(f"'{param}' contains the special token {found[0]!r}",
                                  param=param, code="special_token_in_prompt")
