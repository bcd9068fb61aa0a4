"""Reasoning ("thinking") text split from the answer, for ``<think>…</think>`` models.

A reasoning model writes its thinking between ``<think>`` and ``</think>`` before the
answer. The server's ``--reasoning-parser`` (vLLM's flag and parser names) says which
convention the served model follows:

* ``qwen3``: the model itself opens the block (Qwen3 with ``enable_thinking``, the
  default of its chat template): text that does not begin with ``<think>`` (leading
  whitespace aside) is all answer, as Qwen3's output with ``enable_thinking: false`` is.
* ``deepseek_r1``: the chat template opens the block in the prompt (DeepSeek-R1 and its
  distills, Qwen3 "thinking-2507" templates), so the output starts inside it; a
  ``<think>`` the model repeats at the start is dropped, and text with no ``</think>``
  is all reasoning (the thinking was cut by ``max_tokens``).

After ``</think>`` everything is answer (only the first block is reasoning), with the
newlines right after the tag dropped. Each front maps the two parts to its own shape:
``reasoning_content`` in chat completions (vLLM's field), reasoning items in the
Responses API, ``thinking`` blocks in Anthropic's Messages.

:class:`ReasoningSplitter` is one state machine for a whole text and for a stream cut
anywhere (a tag split across token pieces is held back until it is told apart):
feeding the pieces and then :meth:`ReasoningSplitter.finish` gives the same two texts
as :func:`split_reasoning` on the joined text, whatever the cuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How one model family marks its thinking.

    Attributes:
        name: the ``--reasoning-parser`` value (vLLM's parser name).
        start, end: the tags around the thinking.
        starts_inside: the prompt already opened the block, so output before ``end`` is
            reasoning even without ``start``.
    """

    name: str
    start: str = THINK_START
    end: str = THINK_END
    starts_inside: bool = False


#: ``--reasoning-parser`` values (vLLM's names for the same conventions).
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The format of parser ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


@dataclass
class ReasoningSplit:
    """Text split into its reasoning and its answer (either may be "")."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_OPENING, _REASONING, _AFTER, _CONTENT = "opening", "reasoning", "after", "content"


class ReasoningSplitter:
    """Splits one output (one choice), fed in pieces, into reasoning and answer.

    Args:
        fmt: the model's :class:`ReasoningFormat`.
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state = _OPENING
        self._held = ""
        #: True once the reasoning block was closed (``end`` seen).
        self.closed = False

    @property
    def thinking(self) -> bool | None:
        """Whether the text so far is inside the reasoning: True inside it (the closing tag
        included), False once the answer has begun, None while that cannot be told yet."""
        if self._state == _OPENING:
            return None
        return self._state == _REASONING

    def feed(self, text: str) -> ReasoningSplit:
        """The parts of ``text`` that can be told now; a possible tag is held back."""
        out = ReasoningSplit()
        self._held += text
        while self._held:
            if not self._step(out):
                break
        return out

    def finish(self) -> ReasoningSplit:
        """What was held back, at the end of the output: a partial tag is text."""
        out = ReasoningSplit()
        held, self._held = self._held, ""
        if self._state == _OPENING:
            if self.fmt.starts_inside:
                out.reasoning = held
            else:
                out.content = held
        elif self._state == _REASONING:
            out.reasoning = held
        elif self._state == _AFTER:
            out.content = held.lstrip("\n")
        else:
            out.content = held
        return out

    def _step(self, out: ReasoningSplit) -> bool:
        """One move of the state machine over ``_held``; False when it must wait for more."""
        held, fmt = self._held, self.fmt
        if self._state == _OPENING:
            lead = held.lstrip()
            if lead.startswith(fmt.start):
                self._held = lead[len(fmt.start):]
                self._state = _REASONING
                return True
            if not lead or fmt.start.startswith(lead):
                return False  # whitespace or a partial start tag so far
            self._state = _REASONING if fmt.starts_inside else _CONTENT
            return True
        if self._state == _REASONING:
            at = held.find(fmt.end)
            if at >= 0:
                out.reasoning += held[:at]
                self._held = held[at + len(fmt.end):]
                self._state, self.closed = _AFTER, True
                return True
            keep = _partial_suffix(held, fmt.end)
            out.reasoning += held[:len(held) - keep]
            self._held = held[len(held) - keep:]
            return False
        if self._state == _AFTER:
            rest = held.lstrip("\n")
            if not rest:
                self._held = ""
                return False
            self._held, self._state = rest, _CONTENT
            return True
        out.content += held
        self._held = ""
        return False


class ReasoningTokens:
    """Counts the output tokens spent on reasoning, for OpenAI's ``reasoning_tokens`` usage
    field (chat completions' ``completion_tokens_details``, Responses'
    ``output_tokens_details``), from the pieces of one choice's output as they arrive.

    A piece counts as reasoning when it was read inside the thinking or closed it (so the
    ``<think>`` and ``</think>`` tags count, as the model spent them thinking); a piece whose
    side cannot be told yet (leading whitespace, part of the opening tag) is held and counted
    once it is. With one token per piece (the worker's default ``--stream-interval 1``) the
    count is exact; a piece of several tokens that holds the closing tag counts whole.

    Args:
        fmt: the model's :class:`ReasoningFormat`.
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._splitter = ReasoningSplitter(fmt)
        self._pending = 0
        #: reasoning tokens so far
        self.count = 0

    def feed(self, text: str, tokens: int) -> None:
        """One piece of the output: its ``text`` and how many tokens it holds."""
        before = self._splitter.thinking
        if before is False:
            return
        self._splitter.feed(text)
        after = self._splitter.thinking
        if after is None:
            self._pending += tokens
        elif after or self._splitter.closed:
            self.count += self._pending + tokens
            self._pending = 0
        else:
            self._pending = 0  # the output had no thinking (qwen3 with enable_thinking off)


def count_reasoning_tokens(pieces: Iterable[tuple[str, int]], fmt: ReasoningFormat) -> int:
    """Reasoning tokens of one choice's whole output, given as ``(text, tokens)`` pieces in
    order (what :class:`ReasoningTokens` counts fed with them)."""
    counter = ReasoningTokens(fmt)
    for text, tokens in pieces:
        counter.feed(text, tokens)
    return counter.count


def split_reasoning(text: str, fmt: ReasoningFormat) -> ReasoningSplit:
    """A whole output split at once (what :class:`ReasoningSplitter` gives for it)."""
    splitter = ReasoningSplitter(fmt)
    first, rest = splitter.feed(text), splitter.finish()
    return ReasoningSplit(first.reasoning + rest.reasoning, first.content + rest.content)
