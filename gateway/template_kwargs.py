"""``chat_template_kwargs`` (vLLM's extra parameter): variables passed to the model's chat
template as they are, e.g. Qwen3's ``{"enable_thinking": false}``, which renders an empty
``<think></think>`` block in the prompt so the model answers without thinking.

The template's own variables (``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``, ``eos_token``) are the server's to set and are refused here. A value is
JSON (the template may print it), and text holding a special token's string is refused:
the template's text becomes control tokens (``Tokenizer.encode_chat``), so a variable must
not be a way to forge a turn (docs/SECURITY.md).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from gateway.errors import InvalidRequestError

PARAM = "chat_template_kwargs"
#: Variables the server sets itself.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                      "raise_exception"})
MAX_BYTES = 16 * 1024  # a switch or two, not a second prompt


def check_chat_template_kwargs(tokenizer: Any, value: Any) -> dict[str, Any]:
    """``value`` checked as template variables ({} for None).

    Raises:
        InvalidRequestError: not an object, a reserved or non-identifier name, larger than
            :data:`MAX_BYTES` as JSON, or holding a special token's text (``param``
            ``chat_template_kwargs[.name]``).
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"'{PARAM}' must be an object", param=PARAM)
    for name in value:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidRequestError(f"'{PARAM}' names must be identifiers, got {name!r}", param=PARAM)
        if name in RESERVED:
            raise InvalidRequestError(f"'{PARAM}.{name}' is set by the server and cannot be passed",
                                      param=f"{PARAM}.{name}")
    text = json.dumps(value, ensure_ascii=False)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequestError(f"'{PARAM}' contains text that is not valid Unicode",
                                  param=PARAM) from None
    if size > MAX_BYTES:
        raise InvalidRequestError(f"'{PARAM}' is larger than {MAX_BYTES} bytes as JSON", param=PARAM)
    special = getattr(tokenizer, "special_tokens_in", None)
    if special is not None:
        found = special(tokenizer.encode(text))
        if found:
            raise InvalidRequestError(f"'{PARAM}' contains the special token {found[0]!r}",
                                      param=PARAM, code="special_token_in_prompt")
    return dict(value)
