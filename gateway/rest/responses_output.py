"""The model's text → the Responses API's output items and stream events.

One :class:`OutputBuilder` per response turns the text, fed in pieces as the worker
streams it (or whole, for a response that is not streamed: the same items either way),
into OpenAI's output items, in order: a ``reasoning`` item for the thinking of a
``<think>`` model (``--reasoning-parser``, ``common.reasoning``), ``message`` items for
the answer text, ``function_call`` items for the calls the tool parser finds
(``gateway.tools.parser``, the chat route's). Each feed returns the typed events of
that piece: ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` (``response.reasoning_text.delta``,
``response.function_call_arguments.delta``), and when an item ends its ``.done``
events and ``response.output_item.done``. Events are dicts without ``sequence_number``;
:class:`EventWriter` numbers and frames them (``event: <type>`` and ``data: <json>``).
Shapes follow OpenAI's API reference ("Responses", "Streaming events").
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Callable

from common.reasoning import ReasoningFormat, ReasoningSplitter, ReasoningTokens
from gateway.tools.spec import ToolSpec
from protos import common_pb2


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: ``prefix`` + ``_`` + 48 hex characters."""
    return f"{prefix}_{secrets.token_hex(24)}"


def usage_of(u: common_pb2.Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses ``usage`` of a finished request (tokens); ``reasoning_tokens``: the
    output tokens spent thinking (:attr:`OutputBuilder.reasoning_tokens`)."""
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class EventWriter:
    """SSE frames of Responses stream events, numbered from 0 (``sequence_number``)."""

    def __init__(self) -> None:
        self._next = 0

    def frame(self, event: dict[str, Any]) -> bytes:
        """``event: <type>`` and ``data: <json>`` of ``event``, with its sequence number."""
        event = {**event, "sequence_number": self._next}
        self._next += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class OutputBuilder:
    """The output items of one response, built from its text piece by piece.

    Args:
        tools: the request's tools when their calls are parsed (``ToolSpec.parses_calls``),
            else None.
        reasoning: the server's reasoning format, or None (all text is answer).
        ids: makes the items' and the calls' ids from a prefix (default :func:`new_id`,
            random; a stream's are ``gateway.rest.stream_rebuild.StableIds``, the same on a
            resuming gateway).
    """

    def __init__(self, tools: ToolSpec | None, reasoning: ReasoningFormat | None,
                 ids: Callable[[str], str] = new_id) -> None:
        self._ids = ids
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None  # index in items of the item still being written
        self._splitter = ReasoningSplitter(reasoning) if reasoning is not None else None
        self._thinking = ReasoningTokens(reasoning) if reasoning is not None else None
        self._calls = tools.stream(lambda: ids("call")) if tools is not None else None
        self._call_items: dict[int, int] = {}  # the parser's call index -> index in items

    # -- feeding -------------------------------------------------------------------------
    @property
    def reasoning_tokens(self) -> int:
        """The output tokens fed so far that were spent thinking (0 without a reasoning format)."""
        return self._thinking.count if self._thinking is not None else 0

    def feed(self, text: str, tokens: int = 0) -> list[dict[str, Any]]:
        """The events of one piece of the model's text (``tokens``: how many it holds)."""
        events: list[dict[str, Any]] = []
        if self._thinking is not None:
            self._thinking.feed(text, tokens)
        if self._splitter is None:
            self._answer(text, events)
            return events
        split = self._splitter.feed(text)
        if split.reasoning:
            self._reasoning(split.reasoning, events)
        if split.content:
            self._answer(split.content, events)
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """The events of the end of the text: what the parsers held back, then the open
        item's end (``incomplete``: the output was cut by ``max_output_tokens``, and the
        item it cut is ``incomplete``). A response with no item gets an empty message."""
        events: list[dict[str, Any]] = []
        if self._splitter is not None:
            split = self._splitter.finish()
            if split.reasoning:
                self._reasoning(split.reasoning, events)
            if split.content:
                self._answer(split.content, events, flush=False)
        if self._calls is not None:
            self._emitted(self._calls.finish(), events)
        if not self.items:
            self._open_message(events)
        self._close(events, "incomplete" if incomplete else "completed")
        return events

    # -- the kinds of text ---------------------------------------------------------------
    def _answer(self, text: str, events: list, flush: bool = False) -> None:
        if self._calls is None:
            self._text(text, events)
        else:
            self._emitted(self._calls.feed(text), events)

    def _emitted(self, emitted: Any, events: list) -> None:
        if emitted.content:
            self._text(emitted.content, events)
        for delta in emitted.calls:
            if delta.id is not None:
                self._open_call(delta, events)
            item = self.items[self._call_items[delta.index]]
            if delta.arguments:
                item["arguments"] += delta.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": self._call_items[delta.index], "delta": delta.arguments})

    def _reasoning(self, text: str, events: list) -> None:
        if not self._is_open("reasoning"):
            self._close(events)
            item = {"type": "reasoning", "id": self._ids("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            index = self._add(item, events)
            item["content"].append({"type": "reasoning_text", "text": ""})
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": {"type": "reasoning_text", "text": ""}})
        index = self._open
        item = self.items[index]
        item["content"][0]["text"] += text
        events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "delta": text})

    def _text(self, text: str, events: list) -> None:
        if not self._is_open("message"):
            self._close(events)
            self._open_message(events)
        index = self._open
        item = self.items[index]
        item["content"][0]["text"] += text
        events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "delta": text, "logprobs": []})

    # -- items ---------------------------------------------------------------------------
    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self.items[self._open]["type"] == kind

    def _add(self, item: dict, events: list) -> int:
        self.items.append(item)
        self._open = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": self._open,
                       "item": _snapshot(item)})
        return self._open

    def _open_message(self, events: list) -> None:
        item = {"type": "message", "id": self._ids("msg"), "status": "in_progress", "role": "assistant",
                "content": []}
        index = self._add(item, events)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "part": dict(part)})

    def _open_call(self, delta: Any, events: list) -> None:
        self._close(events)
        item = {"type": "function_call", "id": self._ids("fc"), "call_id": delta.id, "name": delta.name,
                "arguments": "", "status": "in_progress"}
        self._call_items[delta.index] = self._add(item, events)

    def _close(self, events: list, status: str = "completed") -> None:
        """End the open item (if any) with its ``.done`` events."""
        if self._open is None:
            return
        index, self._open = self._open, None
        item = self.items[index]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events.append({"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": part["text"], "logprobs": []})
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": dict(part)})
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": part["text"]})
            events.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": dict(part)})
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": _snapshot(item)})


def _snapshot(item: dict) -> dict:
    """A copy of ``item`` as it is now (events must not change when the item grows)."""
    return json.loads(json.dumps(item))


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as chat messages for a later turn (``previous_response_id``): the
    messages' text and the calls in one assistant message; reasoning left out."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
