"""GenerationStream against a scripted ASGI connection: the generation is closed
(work cancelled, in-flight slot released) as soon as the client goes, wherever
the stream happens to be waiting, and whatever ASGI spec version the server speaks."""

import asyncio

import pytest

from gateway.rest.delivery import GenerationStream


class RecordingGeneration:
    """Stands in for ``Generation``: the response uses ``close``, ``done`` and ``request_id``."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.done = False
        self.request_id = "req-recording"

    async def close(self) -> None:
        self.closed.set()


async def frames(after_first: asyncio.Event):
    """One frame, then silence until ``after_first`` is set (a slow model)."""
    yield b"data: first\n\n"
    await after_first.wait()
    yield b"data: second\n\n"


def scope(spec_version: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_disconnect_while_the_model_is_silent_closes_the_generation(spec_version):
    async def run():
        gen, never, sent, gone = RecordingGeneration(), asyncio.Event(), [], asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message.get("body") == b"data: first\n\n":
                gone.set()  # the client reads one frame and leaves
        response = GenerationStream(gen, frames(never))
        await asyncio.wait_for(response(scope(spec_version), receive, send), timeout=5)
        assert gen.closed.is_set()
        assert [m.get("body") for m in sent] == [None, b"data: first\n\n"]

    asyncio.run(run())


def test_disconnect_while_blocked_on_a_full_socket_closes_the_generation():
    """The send never completes (the client stopped reading, the buffers are full):
    cancelled there, the body generator is left suspended at a ``yield``; the
    generation must still be closed at once, not when that generator is collected."""
    async def run():
        gen, never, gone = RecordingGeneration(), asyncio.Event(), asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message.get("body"):
                gone.set()
                await asyncio.Event().wait()  # blocked forever
        body = frames(never)
        response = GenerationStream(gen, body)
        await asyncio.wait_for(response(scope("2.3"), receive, send), timeout=5)
        assert gen.closed.is_set()
        assert body.ag_frame is None  # closed too, not left for the finalizer

    asyncio.run(run())


def test_normal_end_closes_once_and_stops_listening():
    async def run():
        gen, ready, sent = RecordingGeneration(), asyncio.Event(), []
        ready.set()

        async def receive():
            await asyncio.Event().wait()  # the client never leaves

        async def send(message):
            sent.append(message)
        await asyncio.wait_for(GenerationStream(gen, frames(ready))(scope("2.3"), receive, send), 5)
        assert gen.closed.is_set()
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}

    asyncio.run(run())


def test_a_failing_send_ends_the_response_like_a_disconnect():
    """ASGI 2.4 servers raise OSError from send() on a closed connection."""
    async def run():
        gen, never = RecordingGeneration(), asyncio.Event()

        async def receive():
            await asyncio.Event().wait()  # the server never reports the disconnect

        async def send(message):
            if message.get("body"):
                raise OSError("connection reset")
        await asyncio.wait_for(GenerationStream(gen, frames(never))(scope("2.4"), receive, send), timeout=5)
        assert gen.closed.is_set()

    asyncio.run(run())
