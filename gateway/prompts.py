"""Turning a completion prompt or chat messages into prompt token ids.

Accepted shapes follow the OpenAI API reference: a completion ``prompt`` is a
string, a list holding one string, or a list of token ids; a chat message has a
``role`` and a ``content`` that is a string or a list of ``{"type": "text",
"text": ...}`` content parts (an assistant message's may be null or absent). Role
``developer`` is OpenAI's newer name for ``system`` and reaches the template as that.

Message content is text (docs/SECURITY.md): a special-token string such as
``<|im_start|>`` inside a content is tokenized as ordinary text, never as a
control token, so a message cannot forge a turn (``Tokenizer.encode_chat``). A
completion prompt is raw model input and may hold special tokens, as in vLLM;
``completion_special_tokens`` (``allow``, ``escape``, ``reject``) says what
happens to them (:func:`apply_completion_special_tokens`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from gateway.errors import InvalidRequestError
from gateway.template_kwargs import check_chat_template_kwargs
from gateway.tools.prompt import render_inputs
from gateway.tools.spec import ToolSpec

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Roles the chat template sees under another name: OpenAI's ``developer`` messages
#: replace ``system`` ones for its newer models, and the templates know only ``system``.
TEMPLATE_ROLE = {"developer": "system"}
COMPLETION_SPECIAL_TOKENS = ("allow", "escape", "reject")


def completion_prompt_ids(tokenizer: Any, prompt: Any, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a completion prompt (tokens); ``add_special_tokens`` (``/tokenize``'s
    flag) adds what the tokenizer adds to a text (the BOS a model asks for); the
    generation routes never do.

    Raises:
        InvalidRequestError: missing/empty prompt, batch prompts, token ids outside the vocabulary.
    """
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = _encode(tokenizer, prompt, "prompt", add_special_tokens)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        ids = list(prompt)
    elif prompt is None:
        raise InvalidRequestError("'prompt' is required", param="prompt")
    else:
        raise InvalidRequestError(
            "'prompt' must be a string, a list with one string, or a list of token ids "
            "(batched prompts are not supported)", param="prompt")
    if not ids:
        raise InvalidRequestError("'prompt' must not be empty", param="prompt")
    return ids


def _content_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text content parts are supported",
                    param=f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts",
                              param=f"messages[{index}].content")


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as ``[{"role", "content"}]`` with string content (``developer`` as ``system``,
    an assistant's null content as ""); an assistant message keeps its ``tool_calls``
    (``[{"id", "type", "function": {"name", "arguments"}}]``), a tool message its
    ``tool_call_id``, for ``gateway.tools.prompt`` to render.

    Raises:
        InvalidRequestError: empty list, unknown role, non-text content, malformed
            ``tool_calls`` or ``tool_call_id``.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:  # a list/dict role is unhashable
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                param=f"messages[{i}].role")
        content = msg.get("content")
        if content is None and role == "assistant":  # OpenAI: optional for an assistant turn
            content = ""
        entry: dict[str, Any] = {"role": TEMPLATE_ROLE.get(role, role),
                                 "content": _content_text(i, content)}
        if role == "assistant" and msg.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(i, msg["tool_calls"])
        if role == "tool" and msg.get("tool_call_id") is not None:
            if not isinstance(msg["tool_call_id"], str):
                raise InvalidRequestError(f"messages[{i}].tool_call_id must be a string",
                                          param=f"messages[{i}].tool_call_id")
            entry["tool_call_id"] = msg["tool_call_id"]
        out.append(entry)
    return out


def _tool_calls(index: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (OpenAI's shape: ``id``, ``type`` "function",
    ``function.name``, ``function.arguments`` a string), checked.

    Raises:
        InvalidRequestError: naming ``messages[index].tool_calls[j]``.
    """
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where} must be a list", param=where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise InvalidRequestError(f'{at} must be {{"id", "type": "function", "function": '
                                      '{"name", "arguments"}}', param=at)
        name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise InvalidRequestError(f"{at}.function needs a string 'name' and a string "
                                      "'arguments' (JSON text)", param=f"{at}.function")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"{at}.id must be a string", param=f"{at}.id")
        out.append({"id": call_id or "", "type": "function",
                    "function": {"name": name, "arguments": arguments}})
    return out


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Any], tools: ToolSpec | None = None,
                    add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of chat messages rendered with the model's chat template (tokens), with
    the request's ``tools`` and any tool-call history in the model's own tool format or
    the Hermes-style one (``gateway.tools.prompt``, docs/TOOLS.md); ``add_generation_prompt``
    (on for every generation; ``/tokenize`` may turn it off) opens the assistant's turn;
    ``template_kwargs`` (the request's ``chat_template_kwargs``, checked by
    ``gateway.template_kwargs``) are more template variables, under the server's own.

    Raises:
        InvalidRequestError: invalid messages, or a template that rejects them.
    """
    normalized = normalize_messages(messages)
    for msg in normalized:
        _check_unicode(msg["content"], "messages")
        for call in msg.get("tool_calls", ()):
            _check_unicode(call["function"]["arguments"], "messages")
    normalized, template_vars = render_inputs(tokenizer, normalized, tools)
    template_vars = {**check_chat_template_kwargs(tokenizer, template_kwargs), **template_vars}
    encode_chat = getattr(tokenizer, "encode_chat", None)  # the real tokenizer; test doubles may lack it
    try:
        if encode_chat is not None:
            ids = list(encode_chat(normalized, add_generation_prompt=add_generation_prompt,
                                   **template_vars))
        else:
            ids = list(tokenizer.encode(tokenizer.apply_chat_template(
                normalized, add_generation_prompt=add_generation_prompt, **template_vars)))
    except Exception as exc:  # jinja2 templates raise on unsupported role orders
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}",
                                  param="messages") from exc
    if not ids:
        raise InvalidRequestError("'messages' rendered to an empty prompt", param="messages")
    return ids


def apply_completion_special_tokens(tokenizer: Any, prompt: Any, mode: str) -> Any:
    """The completion ``prompt`` under the ``completion_special_tokens`` setting.

    ``allow``: ``prompt`` unchanged (special-token strings in it are control tokens,
    as in vLLM). ``escape``: a string prompt becomes the token ids of its text with
    special-token strings tokenized as text. ``reject``: a prompt holding a special
    token (as a string or as an id) is a 400 naming it; otherwise a string prompt
    becomes its token ids. Token-id prompts pass unchanged under ``escape``: ids
    say what they mean. Anything that is not a usable prompt is returned as it is,
    for :func:`completion_prompt_ids` to reject with its usual error.

    Raises:
        InvalidRequestError: ``reject`` and a special token in ``prompt``; text that
            is not valid Unicode.
        ValueError: an unknown ``mode``.
    """
    if mode not in COMPLETION_SPECIAL_TOKENS:
        raise ValueError(f"completion_special_tokens must be one of {COMPLETION_SPECIAL_TOKENS}, got {mode!r}")
    special = getattr(tokenizer, "special_token_ids", frozenset())
    if mode == "allow" or not special:
        return prompt
    text = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) else prompt
    if isinstance(text, str):
        if not text:
            return prompt
        _check_unicode(text, "prompt")
        if mode == "escape":
            return list(tokenizer.encode_text(text))
        ids = list(tokenizer.encode(text))
    elif isinstance(text, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        if mode == "escape":
            return prompt
        ids = text
    else:
        return prompt
    for i in ids:
        if i in special:
            name = tokenizer.hf.id_to_token(i) if hasattr(tokenizer, "hf") else str(i)
            raise InvalidRequestError(
                f"'prompt' contains the special token {name!r} (id {i}); this server does not accept "
                "special tokens in completion prompts", param="prompt", code="special_token_in_prompt")
    return ids


def _check_unicode(text: str, param: str) -> None:
    """Text that is not valid Unicode (a lone surrogate such as ``"\\ud800"`` from
    JSON) is a 400 naming ``param``, not a tokenizer crash."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"'{param}' contains text that is not valid Unicode ({exc.reason})",
                                  param=param) from exc


def _encode(tokenizer, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` (special-token strings are special tokens), after
    :func:`_check_unicode`."""
    _check_unicode(text, param)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
