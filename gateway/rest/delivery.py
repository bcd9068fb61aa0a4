"""Delivering a :class:`Generation` to an HTTP client: SSE stream or one JSON body.

A client that disconnects (mid-stream, or while a non-streaming request is
still running) ends the generation, which sends ``Cancel`` to the worker (or
XDELs the still-queued entry) and releases the key's in-flight slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Mapping, Sequence

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from common.reasoning import ReasoningFormat, ReasoningTokens
from gateway.errors import InflightError, error_body
from gateway.rest import openai_format as fmt
from gateway.service import Generation
from gateway.stream_journal import event_id
from protos import link_pb2

log = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request": the client left before the answer

class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(gen: Generation) -> fmt.Transcript:
    transcript = fmt.Transcript()
    async for event in gen.events():
        transcript.add(event)
    transcript.usage = gen.usage
    return transcript


async def collect_or_cancel(request: Request, gen: Generation) -> fmt.Transcript:
    """All events of ``gen``; cancels it when the client disconnects first.

    Raises:
        ClientGone: the client disconnected.
        InflightError: the request failed (worker error, deadline, lost link).
    """
    collect = asyncio.ensure_future(_collect(gen))
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if collect.done():
            return collect.result()
        raise ClientGone()
    finally:
        for task in (collect, disconnect):
            task.cancel()
        await gen.close()


#: Builds the chunk(s) of one delta, finish or usage: one chunk, or a list of them
#: (``gateway.rest.tool_stream.ToolCallChunks``: none, or content and tool-call deltas).
ChunkBuilder = Callable[..., "dict | list[dict]"]


def _listed(chunks: dict | list[dict]) -> list[dict]:
    return chunks if isinstance(chunks, list) else [chunks]


@dataclass(frozen=True)
class StreamUsage:
    """Where a stream reports usage (``stream_options``): ``include`` (OpenAI's
    ``include_usage``) adds the final usage-only chunk and ``"usage": null`` on the others;
    ``continuous`` (vLLM's ``continuous_usage_stats``, with ``include``) puts the usage so
    far on every chunk instead of the null."""

    include: bool = False
    continuous: bool = False


async def sse_stream(gen: Generation, build_chunk: ChunkBuilder, usage: StreamUsage,
                     first_chunks: Sequence[dict] = (),
                     on_text: Callable[[str], None] | None = None,
                     reasoning: ReasoningFormat | None = None,
                     had: Sequence[link_pb2.Delta] = (), seen: int = 0) -> AsyncIterator[bytes]:
    """SSE frames for ``gen``: the ``first_chunks`` (chat: each choice's role chunk), one
    chunk per delta, a finish chunk per choice (each with the choice's ``index``), a
    usage-only chunk when ``usage.include``, then ``[DONE]``. The usage counts the prompt
    once and the completion tokens of every choice.
    Every chunk has an ``id:`` line, ``<request id>/<output tokens so far>``
    (gateway/stream_journal.py), the point a reconnect with ``Last-Event-ID`` resumes from;
    a resumed generation (``gen.resumed``) starts at ``gen.offset`` and sends no first chunks
    again. The closing chunks, every one after the last delta's (each choice's finish chunk
    and what its builder held back, then the usage chunk), are one write, the ``k``-th (from
    1) with the id ``<request id>/<offset>.<k>`` (``offset`` all output tokens): ``seen``
    (``ResumePoint.after``, a resume at ``.<k>``) of them the client has, not sent again.
    A choice's finish chunk waits for the others' (``n`` > 1: sent in the order of the
    choices' ``index`` once all ended), so the closing chunks are the same whether the
    stream is live, relayed or replayed from its journal (which holds the finishes apart
    from the deltas, in ``index`` order).
    The chunks of one delta (the reasoning and the answer part, say) go out in one write.
    A failure mid-stream is sent as ``data: {"error": ...}`` before ``[DONE]``.
    ``on_text`` (the content debug log) gets each choice's whole text at the end. With
    ``reasoning`` (the server's ``--reasoning-parser``, chat only) the final usage has
    ``completion_tokens_details.reasoning_tokens`` (common/reasoning.py, ``ReasoningTokens``;
    a resumed stream counts from its resume point unless ``had`` says what came before).
    ``had`` (a resume: ``ResumePoint.deltas``, the deltas its client has) is fed to
    ``build_chunk``, the reasoning count and ``on_text`` first, its chunks dropped: a builder
    with state (tool calls, reasoning) goes on from where the client's parse is, so the rest
    continues it (a call's arguments, the thinking) instead of starting a fresh parse.
    Closing ``gen`` is left to the response that sends these frames (:class:`GenerationStream`)."""
    texts: dict[int, list[str]] = {}
    prompt_tokens, completion_tokens = gen.request.prompt_tokens, gen.offset
    thinking: dict[int, ReasoningTokens] = {}

    #: The finish chunks of the choices that ended, by index, sent once all have.
    ended: dict[int, list[dict]] = {}

    def frame(chunk: dict, final: dict | None = None, after: int = 0) -> bytes:
        if usage.include:
            if final is None and usage.continuous:
                final = fmt.running_usage(prompt_tokens, completion_tokens)
            chunk["usage"] = final
        return b"id: " + event_id(gen.request_id, completion_tokens, after).encode() + b"\n" + fmt.sse_frame(chunk)

    def pending() -> list[tuple[dict, bool]]:
        """The held finish chunks in ``index`` order, each with True for the last choice's."""
        last = max(ended, default=-1)
        held = [(chunk, index == last) for index in sorted(ended) for chunk in ended[index]]
        ended.clear()
        return held

    def note(event: link_pb2.Delta) -> bool:
        """Count and log ``event``; True when it makes chunks."""
        if reasoning is not None:
            thinking.setdefault(event.index, ReasoningTokens(reasoning)).feed(event.text, len(event.token_ids))
        if on_text is not None:
            texts.setdefault(event.index, []).append(event.text)
        return bool(event.text or event.logprobs)

    for event in had:  # what the client has: the state its chunks left, none sent again
        if note(event):
            _listed(build_chunk(text=event.text, logprobs=list(event.logprobs), index=event.index))
    try:
        for chunk in () if gen.resumed else first_chunks:
            yield frame(chunk)
        async for event in gen.events():
            if isinstance(event, link_pb2.Delta):
                completion_tokens += len(event.token_ids)
                if note(event):
                    # one write: a break between a delta's chunks (reasoning then content) would
                    # leave its client with the first under the id of both, the rest lost on resume
                    frames = b"".join(frame(chunk) for chunk in _listed(build_chunk(
                        text=event.text, logprobs=list(event.logprobs), index=event.index)))
                    if frames:
                        yield frames
                continue
            # A choice ended; gen.done once it was the last (gen.usage is then complete).
            ended[event.index] = _listed(build_chunk(text=None, finish=fmt.finish_reason(event),
                                                     index=event.index))
            if not gen.done:
                continue
            spent = sum(c.count for c in thinking.values()) if reasoning is not None else None
            final = fmt.usage_from(gen.usage, spent).model_dump(exclude_none=True)
            closing = [(chunk, final if usage.continuous and last else None) for chunk, last in pending()]
            if on_text is not None:
                for index in range(gen.request.n):
                    on_text("".join(texts.get(index, [])))
            if usage.include:
                closing += [(chunk, final) for chunk in _listed(build_chunk(no_choices=True))]
            frames = b"".join(frame(chunk, usage_of, k)
                              for k, (chunk, usage_of) in enumerate(closing, 1) if k > seen)
            if frames:
                yield frames
        if ended:  # the events ended before every choice did
            yield b"".join(frame(chunk) for chunk, _last in pending())
        yield fmt.DONE_FRAME
    except InflightError as exc:
        if ended:
            yield b"".join(frame(chunk) for chunk, _last in pending())
        yield fmt.sse_frame(error_body(exc))
        yield fmt.DONE_FRAME


class GenerationStream(StreamingResponse):
    """The SSE response for one :class:`Generation`.

    Unlike a plain ``StreamingResponse`` it always watches for the client's
    disconnect while streaming (Starlette stops doing so for ASGI spec 2.4
    servers and relies on a failing ``send``, which uvicorn turns into a silent
    no-op), and it closes the generation once the response ends however it ends:
    normal end, disconnect, cancellation or error. The close cancels the work
    and releases the in-flight slot at once instead of whenever the abandoned
    body generator is finalized by the garbage collector.
    """

    def __init__(self, gen: Generation, frames: AsyncIterator[bytes],
                 headers: Mapping[str, str] | None = None, idle_timeout_s: float | None = None) -> None:
        super().__init__(frames, media_type="text/event-stream", headers=headers)
        self.generation = gen
        #: A send that blocks this long (the client stopped reading: its socket and our
        #: write buffer are full) ends the stream, which cancels the request (None: never).
        self.idle_timeout_s = idle_timeout_s
        #: True once the stream was cancelled for an unread client.
        self.stalled = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point; a failing send (OSError, how ASGI 2.4 servers report a
        closed connection) ends the response like a disconnect."""
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._stream_then_stop, send, group.cancel_scope)
                await self.listen_for_disconnect(receive)
                if not self.generation.done:  # the edge's send_timeout, or the client hung up
                    log.info("stream %s: the client went away before its end; cancelled",
                             self.generation.request_id, extra={"request_id": self.generation.request_id})
                group.cancel_scope.cancel()
        finally:
            await self.generation.close()  # survives our own cancellation
            with contextlib.suppress(RuntimeError):  # still running: its task was cancelled
                await self.body_iterator.aclose()

    async def _stream_then_stop(self, send: Send, scope: anyio.CancelScope) -> None:
        try:
            await self.stream_response(self._bounded(send))
        except OSError:
            pass  # the client is gone
        except TimeoutError:
            self.stalled = True
            log.warning("stream %s: the client took no chunk for %.0f s; cancelled",
                        self.generation.request_id, self.idle_timeout_s,
                        extra={"request_id": self.generation.request_id})
        finally:
            scope.cancel()

    def _bounded(self, send: Send) -> Send:
        """``send`` that raises TimeoutError when one message waits longer than
        ``idle_timeout_s`` for the client (the server's flow control blocks a send while
        the socket's buffers are full)."""
        if self.idle_timeout_s is None:
            return send
        limit = self.idle_timeout_s

        async def bounded(message) -> None:
            with anyio.fail_after(limit):
                await send(message)
        return bounded
