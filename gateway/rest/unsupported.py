"""OpenAI request fields this server does not implement: a clear 400, never silence.

A client that sends the legacy ``functions`` expects a ``function_call`` message back;
answering as if they were absent would return plausible but wrong results. LiteLLM
likewise raises for a parameter a provider does not support unless told to drop it.
Fields set to their neutral value (``functions: []``, ``function_call: "none"``) are
accepted; ``tools``/``tool_choice`` (``gateway.tools``) and ``response_format``
(``gateway.admission.structured``) are served. So are the knobs this server does not implement
(``best_of``, beam search, ``echo``, ``suffix``) at their neutral values only:
``best_of: 1`` is what the client gets, ``3`` is refused. (The penalties,
``min_p``, ``min_tokens`` and ``logit_bias`` are served: validation checks them.)
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequestError


# Field -> the values that ask for nothing (OpenAI's and vLLM's defaults).
NEUTRAL = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
           "use_beam_search": (None, False), "length_penalty": (None, 1)}


def check_unsupported(body: Any) -> None:
    """Raise for the first unsupported feature the request body asks for, or for
    ``stream_options`` sent without ``stream: true`` (refused by OpenAI and vLLM too).

    Args:
        body: a ``CompletionRequest`` or ``ChatCompletionRequest``.

    Raises:
        InvalidRequestError: naming the parameter (``code`` "unsupported_parameter").
    """
    if getattr(body, "stream_options", None) is not None and not getattr(body, "stream", False):
        # as OpenAI and vLLM answer: the options of a stream that is not streamed ask for nothing
        raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true",
                                  param="stream_options", code="invalid_value")
    if getattr(body, "functions", None):
        raise _unsupported("functions", "the legacy 'functions' are not supported by this server; "
                                        "send them as 'tools'")
    if getattr(body, "function_call", None) not in (None, "none"):
        raise _unsupported("function_call", "the legacy 'function_call' is not supported by this "
                                            "server; use 'tool_choice'")
    for name, neutral in NEUTRAL.items():
        value = getattr(body, name, None)
        if not _is_neutral(value, neutral):
            raise _unsupported(name, f"{name}={value!r} is not supported by this server "
                                     f"(accepted: {neutral[1]!r} or absent)")


def _is_neutral(value: Any, neutral: tuple) -> bool:
    """``value`` is one of ``neutral``: the same object (None, False, "") or an equal
    plain number (``0.0`` for ``0``; ``True`` is not ``1``)."""
    return any(value is n or (type(value) in (int, float) and type(n) is not bool and value == n)
               for n in neutral)


def _unsupported(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="unsupported_parameter")
