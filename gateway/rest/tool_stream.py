"""Streamed tool calls: a chat chunk builder that sends each choice's text through its own
:class:`~gateway.tools.parser.ToolCallStream`, so a stream carries OpenAI's ``tool_calls``
deltas (``index``; ``id``, ``type`` and ``function.name`` first, then ``function.arguments``
fragments) where the model wrote calls, and ``content`` for the rest. The calls' ids come
from the stream's internal id (gateway/rest/stream_rebuild.py, ``StableIds``), so a gateway
that resumes the stream rebuilds the same calls (``sse_stream``'s ``had``)."""

from __future__ import annotations

from typing import Callable

from gateway.rest.openai_format import tool_calls_finish
from gateway.rest.stream_rebuild import StableIds
from gateway.tools.parser import Emitted, ToolCallStream
from gateway.tools.spec import ToolSpec


class ToolCallChunks:
    """A drop-in for ``functools.partial(openai_format.chat_chunk, rid, model, created)`` in
    ``gateway.rest.delivery.sse_stream``, returning a list of chunks per call: none while
    the parser holds text back (a possible tag), the content and call deltas otherwise,
    and at a choice's finish what the parser still held, then the finish chunk (its
    ``finish_reason`` "tool_calls" when the choice made calls and ended on its own).

    Args:
        chunk: the plain chat chunk builder.
        tools: the request's tools (``tool_choice`` other than ``none``).
        seed: the stream's internal request id; choice ``i``'s calls get the ids of
            ``StableIds(f"{seed}/{i}")``, the same on every gateway that builds its chunks.
    """

    def __init__(self, chunk: Callable[..., dict], tools: ToolSpec, seed: str) -> None:
        self._chunk = chunk
        self._tools = tools
        self._seed = seed
        self._streams: dict[int, ToolCallStream] = {}  # per choice index

    def _stream(self, index: int) -> ToolCallStream:
        if index not in self._streams:
            ids = StableIds(f"{self._seed}/{index}")
            self._streams[index] = self._tools.stream(lambda: ids("call"))
        return self._streams[index]

    def _emit(self, emitted: Emitted, index: int, logprobs: list | None = None) -> list[dict]:
        if not emitted and not logprobs:
            return []
        return [self._chunk(text=emitted.content or None, logprobs=logprobs, index=index,
                            tool_calls=[d.openai() for d in emitted.calls])]

    def __call__(self, *, text: str | None = None, logprobs: list | None = None,
                 finish: str | None = None, no_choices: bool = False, index: int = 0) -> list[dict]:
        """The chunks for one delta of choice ``index`` (``text``), its finish (``finish``)
        or the final usage-only chunk (``no_choices``)."""
        if no_choices:
            return [self._chunk(no_choices=True)]
        stream = self._stream(index)
        if finish is None:
            return self._emit(stream.feed(text or ""), index, logprobs)
        rest = self._emit(stream.finish(), index)
        reason = tool_calls_finish(finish) if stream.calls else finish
        return rest + [self._chunk(text=None, finish=reason, index=index)]
