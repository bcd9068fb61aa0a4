"""Worker output (``link_pb2.Delta``/``Finished``) → OpenAI response objects and SSE frames.

Shapes follow the OpenAI API reference and what OpenAI really sends: chat logprobs as
``{"content": [{token, logprob, bytes, top_logprobs}]}``, completion logprobs as
``{tokens, token_logprobs, top_logprobs, text_offset}``, streams as ``data: {...}\\n\\n``
frames ending with ``data: [DONE]``. A stream chunk carries no ``null`` that OpenAI
leaves out: a chat ``delta`` is ``{"role": "assistant", "content": ""}`` first, then
``{"content": ...}``, then ``{}`` with the finish; ``usage`` is there only with
``stream_options.include_usage`` (``null`` on every chunk but the last, usage-only one,
as OpenAI sends it), or on every chunk with vLLM's ``continuous_usage_stats`` too.
Every object carries :data:`SYSTEM_FINGERPRINT`. A request with ``n`` > 1 has n choices,
each with its ``index``: a response lists them in index order; a stream interleaves
their chunks (each choice's own role chunk, deltas and finish chunk) and its usage
counts the prompt once and every choice's completion tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import metadata

from pydantic import BaseModel

from common.reasoning import ReasoningFormat, count_reasoning_tokens, split_reasoning
from gateway.rest import schemas
from gateway.tools.parser import parse_tool_calls
from gateway.tools.spec import ToolSpec
from protos import common_pb2, link_pb2

DONE_FRAME = b"data: [DONE]\n\n"
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


def _version() -> str:
    try:
        return metadata.version("inflight-serve")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "dev"


#: OpenAI's ``system_fingerprint``: the backend configuration that produced a response.
VERSION = _version()
SYSTEM_FINGERPRINT = f"fp_inflight_{VERSION}"


def finish_reason(finished: link_pb2.Finished) -> str:
    """OpenAI's finish_reason ("stop" or "length") for a successful ``Finished``."""
    return _FINISH.get(finished.finish_reason, "stop")


def usage_of(finished: link_pb2.Finished) -> schemas.Usage:
    """Token usage of one finished choice (tokens); see :func:`usage_from`."""
    return usage_from(finished.usage)


def usage_from(u: common_pb2.Usage, reasoning_tokens: int | None = None) -> schemas.Usage:
    """OpenAI's ``usage`` of a request (tokens; ``Generation.usage``: the prompt once, the
    choices' completion tokens summed); ``prompt_tokens_details.cached_tokens`` is the
    prompt served from the worker's prefix cache; ``reasoning_tokens`` (not None: the server
    has a ``--reasoning-parser``) goes to ``completion_tokens_details``."""
    details = (schemas.CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
               if reasoning_tokens is not None else None)
    return schemas.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                         total_tokens=u.prompt_tokens + u.completion_tokens,
                         prompt_tokens_details=schemas.PromptTokensDetails(
                             cached_tokens=u.cached_prompt_tokens),
                         completion_tokens_details=details)


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage so far of a request still streaming (vLLM's ``continuous_usage_stats``)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse_frame(payload: BaseModel | dict) -> bytes:
    """One SSE frame ``data: <json>\\n\\n``."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + body.encode() + b"\n\n"


def chat_logprobs(items: list[link_pb2.TokenLogprob]) -> dict | None:
    """Chat-format logprobs, or None when there are none. ``bytes`` are the token's
    raw bytes from the worker: joined over consecutive tokens they give the UTF-8 of
    a character that the tokens split, where each ``token`` alone shows U+FFFD."""
    if not items:
        return None
    def entry(t: common_pb2.TokenLogprob | common_pb2.TopLogprob) -> dict:
        raw = t.token_bytes or t.token.encode()  # a worker from before token_bytes sends none
        return {"token": t.token, "logprob": t.logprob, "bytes": list(raw)}
    return {"content": [dict(entry(t), top_logprobs=[entry(a) for a in t.top]) for t in items]}


def completion_logprobs(items: list[link_pb2.TokenLogprob], text_offset: int = 0) -> dict | None:
    """Legacy completion-format logprobs, or None when there are none. Each token's
    ``top_logprobs`` holds the sampled token first, then the ``logprobs`` most likely ones,
    so ``logprobs`` or ``logprobs`` + 1 entries (one with ``logprobs: 0``): OpenAI's "the
    API will always return the logprob of the sampled token", and vLLM's. Being keyed by the
    token's text, distinct tokens of the same text (U+FFFD of split characters) share one."""
    if not items:
        return None
    offsets, pos = [], text_offset
    for t in items:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{t.token: t.logprob, **{a.token: a.logprob for a in t.top}} for t in items],
            "text_offset": offsets}


@dataclass
class ChoiceTranscript:
    """Everything received for one choice of a non-streaming request."""

    text: list[str] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)  # tokens of each piece of ``text``
    logprobs: list[link_pb2.TokenLogprob] = field(default_factory=list)
    finished: link_pb2.Finished | None = None

    def pieces(self) -> list[tuple[str, int]]:
        """``(text, tokens)`` of each delta received, in order."""
        return list(zip(self.text, self.token_counts))


@dataclass
class Transcript:
    """Everything received for one non-streaming request: its choices by index, and
    the request's usage (set when the request ended, ``Generation.usage``)."""

    choices: dict[int, ChoiceTranscript] = field(default_factory=dict)
    usage: common_pb2.Usage | None = None

    def add(self, event: link_pb2.Delta | link_pb2.Finished) -> None:
        """Fold one streamed delta or a choice's ``Finished`` into the response."""
        choice = self.choices.setdefault(event.index, ChoiceTranscript())
        if isinstance(event, link_pb2.Delta):
            choice.text.append(event.text)
            choice.token_counts.append(len(event.token_ids))
            choice.logprobs.extend(event.logprobs)
        else:
            choice.finished = event

    def ordered(self) -> list[tuple[int, ChoiceTranscript]]:
        """``(index, choice)`` in index order."""
        return sorted(self.choices.items())

    def texts(self) -> list[str]:
        """Each choice's whole text, in index order."""
        return ["".join(c.text) for _, c in self.ordered()]


def completion_response(rid: str, model: str, created: int, t: Transcript,
                        ) -> schemas.CompletionResponse:
    """The ``text_completion`` object for a finished request."""
    choices = [schemas.CompletionChoice(index=i, text="".join(c.text),
                                        logprobs=completion_logprobs(c.logprobs),
                                        finish_reason=finish_reason(c.finished))
               for i, c in t.ordered()]
    return schemas.CompletionResponse(id=f"cmpl-{rid}", created=created, model=model,
                                      choices=choices, usage=usage_from(t.usage),
                                      system_fingerprint=SYSTEM_FINGERPRINT)


def chat_response(rid: str, model: str, created: int, t: Transcript,
                  tools: ToolSpec | None = None, reasoning: ReasoningFormat | None = None,
                  ) -> schemas.ChatCompletionResponse:
    """The ``chat.completion`` object for a finished request; with ``reasoning`` (the
    server's ``--reasoning-parser``) each choice's thinking goes to ``reasoning_content``
    first; with ``tools`` (other than ``tool_choice: "none"``) each choice's answer is
    parsed for tool calls on its own."""
    choices = [_chat_choice(i, c, tools, reasoning) for i, c in t.ordered()]
    thinking = (sum(count_reasoning_tokens(c.pieces(), reasoning) for _, c in t.ordered())
                if reasoning is not None else None)
    return schemas.ChatCompletionResponse(id=f"chatcmpl-{rid}", created=created, model=model,
                                          choices=choices, usage=usage_from(t.usage, thinking),
                                          system_fingerprint=SYSTEM_FINGERPRINT)


def _chat_choice(index: int, choice: ChoiceTranscript, tools: ToolSpec | None,
                 reasoning: ReasoningFormat | None = None) -> schemas.ChatChoice:
    """One choice of a ``chat.completion``: its text, or with tools the parsed content and
    calls, and ``finish_reason`` "tool_calls" when it made calls and ended on its own;
    with ``reasoning`` the thinking split off first (``reasoning_content``)."""
    text, finish = "".join(choice.text), finish_reason(choice.finished)
    thinking = None
    if reasoning is not None:
        split = split_reasoning(text, reasoning)
        text, thinking = split.content, split.reasoning or None
    message = schemas.AssistantMessage(content=text, reasoning_content=thinking)
    if tools is not None and tools.parses_calls:
        parsed = parse_tool_calls(text, tools.names, incremental=tools.must_call)
        if parsed.calls:
            message = schemas.AssistantMessage(content=parsed.content, reasoning_content=thinking,
                                               tool_calls=[schemas.ToolCall.model_validate(call.openai())
                                                           for call in parsed.calls])
            finish = tool_calls_finish(finish)
    return schemas.ChatChoice(index=index, message=message, logprobs=chat_logprobs(choice.logprobs),
                              finish_reason=finish)


def tool_calls_finish(finish: str) -> str:
    """A choice that made tool calls: "tool_calls" where it ended by itself ("stop"), as
    OpenAI reports it; "length" stays (the output was cut)."""
    return "tool_calls" if finish == "stop" else finish


def chat_chunk(rid: str, model: str, created: int, *, role: bool = False, text: str | None = None,
               logprobs: list | None = None, finish: str | None = None, no_choices: bool = False,
               index: int = 0, tool_calls: list[dict] | None = None,
               reasoning: str | None = None) -> dict:
    """One ``chat.completion.chunk`` of choice ``index`` (``usage`` is the stream's to add);
    ``no_choices`` gives the final usage-only chunk's body. The delta holds only what is
    set: ``role`` on a choice's first chunk, ``reasoning_content`` (vLLM's field) when
    ``reasoning`` is given, ``content`` when ``text`` is not None, ``tool_calls``
    (OpenAI's streamed call deltas) when given."""
    delta: dict = {"role": "assistant"} if role else {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if text is not None:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = merged_call_deltas(tool_calls)
    choices = [] if no_choices else [{"index": index, "delta": delta,
                                      "logprobs": chat_logprobs(logprobs or []),
                                      "finish_reason": finish}]
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}


def merged_call_deltas(calls: list[dict]) -> list[dict]:
    """Streamed tool-call deltas with one entry per call ``index``, in first-seen order, as
    OpenAI sends them: a later entry's ``function.arguments`` is appended to the first's and
    its other fields fill what the first lacks. A parser step that opened a call and began
    its arguments gave two entries of one index in one chunk; the ``openai`` package merges
    them, a client reading ``tool_calls[0]`` lost the second's arguments."""
    merged: dict[int, dict] = {}
    for call in calls:
        index = call.get("index", 0)
        if index not in merged:
            merged[index] = {**call, **({"function": dict(call["function"])} if "function" in call else {})}
            continue
        first = merged[index]
        for key, value in call.items():
            if key != "function":
                first.setdefault(key, value)
        if "function" in call:
            fn = first.setdefault("function", {})
            for key, value in call["function"].items():
                fn[key] = fn.get(key, "") + value if key == "arguments" else fn.get(key, value)
    return list(merged.values())


def completion_chunk(rid: str, model: str, created: int, *, text: str | None = "",
                     logprobs: list | None = None, finish: str | None = None,
                     no_choices: bool = False, index: int = 0) -> dict:
    """One streamed ``text_completion`` chunk of choice ``index`` (``usage`` is the
    stream's to add)."""
    choices = [] if no_choices else [{"index": index, "text": text or "",
                                      "logprobs": completion_logprobs(logprobs or []),
                                      "finish_reason": finish}]
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}
