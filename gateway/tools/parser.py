"""The model's text → OpenAI ``tool_calls``, whole or streamed (the Hermes format,
docs/TOOLS.md): a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

One state machine serves both: :class:`ToolCallStream` takes the text in any pieces
and gives content and call deltas; :func:`parse_tool_calls` feeds it the whole text
at once, so a response and the concatenation of a stream's deltas always agree.

* A block is a call when its body is a JSON object whose ``name`` is one of the
  request's functions and whose ``arguments`` is an object (absent: ``{}``; a JSON
  string holding an object is taken too). Any other block (bad JSON, an unknown name,
  a block still open when the text ends) stays content, byte for byte, so text that
  is not a call is never lost; the parser never raises on any text.
* Whitespace that only separates a call from the text around it is dropped: content
  is the text before, between and after the calls.
* ``arguments`` is the JSON text of the arguments as the model wrote it when the body
  starts ``{"name": "<name>", "arguments":`` (what the format asks for), else the
  arguments re-serialized.
* ``incremental`` (for requests whose grammar guarantees the format: ``tool_choice``
  ``required`` or a named function) streams a call's arguments as they are written: the
  name as soon as it is complete, then argument fragments. Without it a call is sent
  once its block closed (it may turn out not to be one), as a name delta then one
  arguments delta.

Streamed deltas follow OpenAI's chunk format: per call an ``index`` (0, 1, ...), the
first delta with ``id``, ``type`` and ``function.name`` (and ``arguments: ""``), the
next ones with ``function.arguments`` fragments.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
#: The start of a body in the documented key order, up to where the arguments begin.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_WS = " \t\r\n"


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random URL-safe characters."""
    return "call_" + secrets.token_urlsafe(18)


@dataclass
class CallDelta:
    """One streamed piece of a tool call.

    Attributes:
        index: the call's position among the choice's calls (0, 1, ...).
        arguments: a fragment of the arguments' JSON text ("" on the first delta).
        id: the call's id (first delta only, else None).
        name: the function's name (first delta only, else None).
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        """The delta's ``tool_calls`` entry in OpenAI's chunk format."""
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class Emitted:
    """What one :meth:`ToolCallStream.feed` (or ``finish``) gives: content text and call deltas."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(frozen=True)
class ToolCall:
    """One complete call: ``id``, function ``name`` and ``arguments`` (a JSON text)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        """The call in OpenAI's message format."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    """A whole choice's text parsed: ``content`` (None when empty and calls were made;
    the text unchanged when none were) and the ``calls``."""

    content: str | None
    calls: tuple[ToolCall, ...]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _split_trailing_ws(text: str) -> tuple[str, str]:
    body = text.rstrip(_WS)
    return body, text[len(body):]


def parse_body(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a block's body, or None when it is not a call
    of one of ``names`` (see the module docstring). Never raises."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    name, args = value["name"], value.get("arguments", {})
    if name not in names:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    raw = _raw_arguments(body)
    if raw is not None and _loads_equal(raw, args):
        return name, raw
    return name, json.dumps(args, ensure_ascii=False)


def _raw_arguments(body: str) -> str | None:
    """The arguments' text as written, for a body in the documented key order: what
    follows ``"arguments":`` up to the body's closing brace, trimmed."""
    match = _HEADER.match(body)
    if match is None:
        return None
    rest = body[match.end():].rstrip(_WS)
    if not rest.endswith("}"):
        return None
    return rest[:-1].rstrip(_WS)


def _loads_equal(text: str, value: Any) -> bool:
    try:
        return json.loads(text) == value
    except (ValueError, RecursionError):
        return False


class ToolCallStream:
    """The incremental parser of one choice's text (see the module docstring).

    Args:
        names: the functions a call may name.
        incremental: stream arguments as written (the format is grammar-enforced).
        call_ids: makes each call's id (default :func:`new_call_id`, random; a resumable
            stream's derive from the stream, so a resuming gateway gives the same ones).
    """

    def __init__(self, names: Iterable[str], incremental: bool = False,
                 call_ids: Callable[[], str] = new_call_id) -> None:
        self._call_ids = call_ids
        self._names = frozenset(names)
        self._incremental = incremental
        self._text = ""       # text outside a block not yet given out
        self._held_ws = ""    # whitespace before a possible call (dropped if one follows)
        self._skip_ws = False  # right after a call: leading whitespace is dropped
        self._block: str | None = None  # the body of an open block, or None outside one
        self._block_ws = ""   # whitespace dropped before the open block
        self._header: CallDelta | None = None  # incremental: the open block's call
        self._args_at = 0      # incremental: where the arguments start in the block
        self._args_sent = ""   # incremental: the argument text given out so far
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Emitted:
        """Content and call deltas that ``text`` (the next piece of the output) completes."""
        out = Emitted()
        if self._block is None:
            self._text += text
        else:
            self._block += text
        self._run(out)
        return out

    def finish(self) -> Emitted:
        """The rest once the text ended: a block still open or a partial tag is content
        (an incremental call already announced gets the rest of its arguments)."""
        out = Emitted()
        if self._block is not None:
            if self._header is not None:
                self._send_args(out, self._block[self._args_at:])
                self._end_call(out, self._args_sent)
            else:
                out.content += self._block_ws + OPEN + self._block
            self._block = None
        out.content += self._held_ws + self._text
        self._held_ws = self._text = ""
        return out

    def _run(self, out: Emitted) -> None:
        while True:
            if self._block is None:
                if not self._scan_text(out):
                    return
            elif not self._scan_block(out):
                return

    def _scan_text(self, out: Emitted) -> bool:
        """Give out the text before a tag; True when a block opened."""
        if self._skip_ws:
            self._text = self._text.lstrip(_WS)
            if not self._text:
                return False
            self._skip_ws = False
        at = self._text.find(OPEN)
        if at < 0:
            keep = _partial_suffix(self._text, OPEN)
            ready, self._text = self._text[:len(self._text) - keep], self._text[len(self._text) - keep:]
            if ready:
                body, ws = _split_trailing_ws(ready)
                if body:
                    out.content += self._held_ws + body
                    self._held_ws = ""
                self._held_ws += ws
            return False
        body, ws = _split_trailing_ws(self._text[:at])
        if body:
            out.content += self._held_ws + body
            self._held_ws = ""
        self._block_ws, self._held_ws = self._held_ws + ws, ""
        self._block, self._text = self._text[at + len(OPEN):], ""
        return True

    def _scan_block(self, out: Emitted) -> bool:
        """Handle an open block; True when it closed (the text after it is scanned next)."""
        assert self._block is not None
        end = self._block.find(CLOSE)
        if end < 0:
            if self._incremental:
                self._stream_open_block(out)
            return False
        body, rest = self._block[:end], self._block[end + len(CLOSE):]
        if self._incremental and self._header is None:
            self._announce(out, body)  # as a stream cut before the close would have
        self._block, self._text = None, rest
        if self._header is not None:  # announced: finish it whatever the body turned out
            self._send_args(out, _announced_args(body[self._args_at:]))
            self._end_call(out, self._args_sent)
            self._skip_ws = True
        elif (parsed := parse_body(body, self._names)) is not None:
            call = CallDelta(index=len(self.calls), id=self._call_ids(), name=parsed[0])
            out.calls += [call, CallDelta(index=call.index, arguments=parsed[1])]
            self.calls.append(ToolCall(call.id, parsed[0], parsed[1]))
            self._skip_ws = True
        else:
            out.content += self._block_ws + OPEN + body + CLOSE
        self._block_ws = ""
        return True

    def _stream_open_block(self, out: Emitted) -> None:
        """Incremental mode: announce the call once its name is known, then stream the
        arguments written so far, holding back what may still be the body's end."""
        assert self._block is not None
        written = self._block[:len(self._block) - _partial_suffix(self._block, CLOSE)]
        if self._header is None and not self._announce(out, written):
            return
        self._send_args(out, written[self._args_at:].rstrip(_WS + "}"))

    def _announce(self, out: Emitted, written: str) -> bool:
        """Announce the open block's call when ``written`` (its body so far, no partial
        close tag) starts with the documented header naming a known function and the
        arguments have begun; True when announced."""
        match = _HEADER.match(written)
        # the arguments must have begun: at the very end the whitespace may not be complete
        if match is None or match.end() == len(written) or _unescape(match.group(1)) not in self._names:
            return False
        self._header = CallDelta(index=len(self.calls), id=self._call_ids(), name=_unescape(match.group(1)))
        self._args_at = match.end()
        out.calls.append(self._header)
        return True

    def _send_args(self, out: Emitted, text: str) -> None:
        """Send what ``text`` adds to the arguments already sent (nothing when it does
        not extend them: what was sent cannot be taken back)."""
        if len(text) > len(self._args_sent) and text.startswith(self._args_sent):
            assert self._header is not None
            out.calls.append(CallDelta(index=self._header.index,
                                       arguments=text[len(self._args_sent):]))
            self._args_sent = text

    def _end_call(self, out: Emitted, arguments: str) -> None:
        assert self._header is not None
        self.calls.append(ToolCall(self._header.id, self._header.name or "", arguments))
        self._header, self._args_at, self._args_sent = None, 0, ""


def _announced_args(written: str) -> str:
    """The arguments of an announced call: what was written, less the body's closing
    brace (for a valid body, the arguments as written)."""
    text = written.rstrip(_WS)
    return text[:-1].rstrip(_WS) if text.endswith("}") else text


def _unescape(name: str) -> str:
    try:
        return json.loads(f'"{name}"')
    except ValueError:
        return name


def parse_tool_calls(text: str, names: Iterable[str], incremental: bool = False) -> ParsedOutput:
    """A whole choice's text parsed (the same result as streaming it in any pieces)."""
    stream = ToolCallStream(names, incremental)
    first, last = stream.feed(text), stream.finish()
    content = first.content + last.content
    if stream.calls:
        return ParsedOutput(content or None, tuple(stream.calls))
    return ParsedOutput(content, ())
