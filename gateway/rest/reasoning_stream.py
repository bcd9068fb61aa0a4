"""Streamed reasoning in chat completions: a chunk builder that sends each choice's text
through its own :class:`~common.reasoning.ReasoningSplitter`, so the thinking of a
``<think>`` model (``--reasoning-parser``) streams as ``reasoning_content`` deltas (vLLM's
field) and only the answer reaches the content (and tool-call) builder behind it."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from common.reasoning import ReasoningFormat, ReasoningSplit, ReasoningSplitter


def _listed(chunks: dict | list[dict]) -> list[dict]:
    return chunks if isinstance(chunks, list) else [chunks]


class ReasoningChunks:
    """A drop-in chunk builder for ``gateway.rest.delivery.sse_stream`` (list of chunks
    per call): the reasoning part of a delta becomes a chunk of ``chunk(reasoning=...)``,
    the answer part goes to ``inner`` (the plain chat chunk builder or
    ``gateway.rest.tool_stream.ToolCallChunks``); at a choice's finish the splitter's
    held text goes out first, then ``inner``'s finish.

    Args:
        chunk: the plain chat chunk builder (``openai_format.chat_chunk`` with its id,
            model and created bound).
        inner: the builder of the answer's chunks.
        fmt: the server's reasoning format.
    """

    def __init__(self, chunk: Callable[..., dict], inner: Callable[..., dict | list[dict]],
                 fmt: ReasoningFormat) -> None:
        self._chunk = chunk
        self._inner = inner
        self._splitters: defaultdict[int, ReasoningSplitter] = defaultdict(
            lambda: ReasoningSplitter(fmt))

    def _emit(self, split: ReasoningSplit, index: int, logprobs: list | None) -> list[dict]:
        out: list[dict] = []
        if split.reasoning:
            # logprobs ride on the reasoning chunk when the delta has no answer part
            out.append(self._chunk(reasoning=split.reasoning, index=index,
                                   logprobs=None if split.content else logprobs))
        if split.content:
            out += _listed(self._inner(text=split.content, index=index, logprobs=logprobs))
        elif logprobs and not split.reasoning:
            out += _listed(self._inner(text=None, index=index, logprobs=logprobs))
        return out

    def __call__(self, *, text: str | None = None, logprobs: list | None = None,
                 finish: str | None = None, no_choices: bool = False, index: int = 0) -> list[dict]:
        """The chunks for one delta of choice ``index`` (``text``), its finish (``finish``)
        or the final usage-only chunk (``no_choices``)."""
        if no_choices:
            return _listed(self._inner(no_choices=True))
        splitter = self._splitters[index]
        if finish is None:
            return self._emit(splitter.feed(text or ""), index, logprobs)
        rest = self._emit(splitter.finish(), index, None)
        return rest + _listed(self._inner(text=None, finish=finish, index=index))
