"""OpenAI request fields this server does not implement: a clear 400, never silence.

A client that sends ``tools`` expects tool calls and one that sends
``logit_bias`` expects biased sampling; answering as if they were absent would
return plausible but wrong results. LiteLLM likewise raises for a parameter a
provider does not support unless told to drop it. Fields set to their neutral
value (``tools: []``, ``tool_choice: "none"``, ``logit_bias: {}``,
``response_format: {"type": "text"}``) are accepted.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequestError


def check_unsupported(body: Any) -> None:
    """Raise for the first unsupported feature the request body asks for.

    Args:
        body: a ``CompletionRequest`` or ``ChatCompletionRequest``.

    Raises:
        InvalidRequestError: naming the parameter (``code`` "unsupported_parameter").
    """
    if getattr(body, "logit_bias", None):
        raise _unsupported("logit_bias", "logit_bias is not supported by this server")
    for name in ("tools", "functions"):
        if getattr(body, name, None):
            raise _unsupported(name, "tool and function calling are not supported by this server")
    for name in ("tool_choice", "function_call"):
        if getattr(body, name, None) not in (None, "none"):
            raise _unsupported(name, "tool and function calling are not supported by this server")
    fmt = getattr(body, "response_format", None)
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _unsupported("response_format", 'only response_format {"type": "text"} is supported')


def _unsupported(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="unsupported_parameter")
