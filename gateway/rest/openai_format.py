"""Worker output (``link_pb2.Delta``/``Finished``) → OpenAI response objects and SSE frames.

Shapes follow the OpenAI API reference: chat logprobs as ``{"content": [{token,
logprob, bytes, top_logprobs}]}``, completion logprobs as ``{tokens,
token_logprobs, top_logprobs, text_offset}``, streams as ``data: {...}\\n\\n``
frames ending with ``data: [DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pydantic import BaseModel

from gateway.rest import schemas
from protos import common_pb2, link_pb2

DONE_FRAME = b"data: [DONE]\n\n"
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


def finish_reason(finished: link_pb2.Finished) -> str:
    """OpenAI's finish_reason ("stop" or "length") for a successful ``Finished``."""
    return _FINISH.get(finished.finish_reason, "stop")


def usage_of(finished: link_pb2.Finished) -> schemas.Usage:
    """Token usage of a finished request (tokens)."""
    u = finished.usage
    return schemas.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                         total_tokens=u.prompt_tokens + u.completion_tokens)


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
    """Legacy completion-format logprobs, or None when there are none."""
    if not items:
        return None
    offsets, pos = [], text_offset
    for t in items:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in items],
            "text_offset": offsets}


@dataclass
class Transcript:
    """Everything received for one non-streaming request."""

    text: list[str] = field(default_factory=list)
    logprobs: list[link_pb2.TokenLogprob] = field(default_factory=list)
    finished: link_pb2.Finished | None = None

    def add(self, event: link_pb2.Delta | link_pb2.Finished) -> None:
        """Fold one streamed delta or the final ``Finished`` into the response."""
        if isinstance(event, link_pb2.Delta):
            self.text.append(event.text)
            self.logprobs.extend(event.logprobs)
        else:
            self.finished = event


def completion_response(rid: str, model: str, created: int, t: Transcript,
                        ) -> schemas.CompletionResponse:
    """The ``text_completion`` object for a finished request."""
    choice = schemas.CompletionChoice(text="".join(t.text), logprobs=completion_logprobs(t.logprobs),
                                      finish_reason=finish_reason(t.finished))
    return schemas.CompletionResponse(id=f"cmpl-{rid}", created=created, model=model,
                                      choices=[choice], usage=usage_of(t.finished))


def chat_response(rid: str, model: str, created: int, t: Transcript,
                  ) -> schemas.ChatCompletionResponse:
    """The ``chat.completion`` object for a finished request."""
    choice = schemas.ChatChoice(message=schemas.AssistantMessage(content="".join(t.text)),
                                logprobs=chat_logprobs(t.logprobs),
                                finish_reason=finish_reason(t.finished))
    return schemas.ChatCompletionResponse(id=f"chatcmpl-{rid}", created=created, model=model,
                                          choices=[choice], usage=usage_of(t.finished))


def chat_chunk(rid: str, model: str, created: int, *, role: bool = False, text: str | None = None,
               logprobs: list | None = None, finish: str | None = None,
               usage: schemas.Usage | None = None, no_choices: bool = False,
               ) -> schemas.ChatCompletionChunk:
    """One ``chat.completion.chunk``; ``no_choices`` gives the final usage-only chunk."""
    choices = [] if no_choices else [schemas.ChatChunkChoice(
        delta=schemas.ChatDelta(role="assistant" if role else None, content=text),
        logprobs=chat_logprobs(logprobs or []), finish_reason=finish)]
    return schemas.ChatCompletionChunk(id=f"chatcmpl-{rid}", created=created, model=model,
                                       choices=choices, usage=usage)


def completion_chunk(rid: str, model: str, created: int, *, text: str | None = "",
                     logprobs: list | None = None, finish: str | None = None,
                     usage: schemas.Usage | None = None, no_choices: bool = False,
                     ) -> schemas.CompletionChunk:
    """One streamed ``text_completion`` chunk."""
    choices = [] if no_choices else [schemas.CompletionChoice(
        text=text or "", logprobs=completion_logprobs(logprobs or []), finish_reason=finish)]
    return schemas.CompletionChunk(id=f"cmpl-{rid}", created=created, model=model,
                                   choices=choices, usage=usage)
