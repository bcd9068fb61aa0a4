"""Startup check of a model's chat template (its own, from ``tokenizer_config.json``,
``chat_template.jinja`` or the GGUF header), so a broken one fails when the server
starts rather than at the first chat request."""

from __future__ import annotations

from typing import Any

_PROBE = "Hello from inflight's startup check"


def check_chat_template(tokenizer: Any) -> str | None:
    """Render a one-message user conversation with ``add_generation_prompt`` through
    ``tokenizer.apply_chat_template`` (:class:`common.tokenizer.Tokenizer`: jinja2
    sandbox, ``bos_token``, ``eos_token``, ``raise_exception``). Templates without a
    system role (Gemma's raise on one) pass: only a user turn is rendered.

    Returns:
        None when the template renders the message; a one-line notice when the model
        has no chat template (a base model: ``/v1/completions`` works, chat requests
        get 400), for the caller to log.

    Raises:
        ValueError: the template does not compile, raises on a plain user message, or
            drops the message's content; one line naming the model.
    """
    name = getattr(tokenizer, "model_name", "model")
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], add_generation_prompt=True)
    except ValueError as exc:
        if "has no chat template" in str(exc):
            return (f"model {name!r} has no chat template: /v1/chat/completions and chat Generate requests "
                    "will be refused (400 / INVALID_ARGUMENT); completions work")
        reason = _one_line(exc).removeprefix("chat template failed: ")
        raise ValueError(f"model {name!r}: chat template unusable: {reason}") from exc
    except Exception as exc:  # noqa: BLE001 - a template may fail in any way jinja2 lets it
        raise ValueError(f"model {name!r}: chat template unusable: {type(exc).__name__}: {_one_line(exc)}") from exc
    if _PROBE not in text:
        raise ValueError(f"model {name!r}: chat template drops the message content")
    return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
