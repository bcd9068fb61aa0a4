"""The relay's look at the owner (gateway/stream_relay.py) against a real Redis: an owner that
journals its last entries and releases its lease right after the relay found nothing new to
read is followed to its finish, not taken for dead. The relay used to read, then check the
lease in a second command: the owner's finish and release landing between the two made a
stream with ``n`` = 2 end with 503 ``not_resumable`` (and one with all its ``max_tokens``
journaled with "only its finish was lost") although every finish was in the journal. Seen
once as a flaky tests/gateway/test_stream_relay.py n=2 case under load."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from gateway.stream_journal import StreamJournal
from gateway.stream_relay import StreamRelay
from protos import common_pb2, link_pb2, queue_pb2

ID = "req-relay-race"


def _message(n: int, max_tokens: int) -> queue_pb2.QueuedRequest:
    message = queue_pb2.QueuedRequest(request_id=ID, prompt_token_ids=[1, 2, 3])
    message.sampling.n, message.sampling.max_tokens = n, max_tokens
    return message


class _OwnerEndsAfterAnEmptyRead:
    """The relay's Redis client: the first time a read of the events stream finds nothing,
    ``end()`` (the owner journals its finishes and releases its lease) runs before the relay's
    next command. Reads through a transaction count once it executed."""

    def __init__(self, client: redis.asyncio.Redis, end):
        self._client, self._end, self.fired = client, end, False

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def _after(self, found) -> None:
        if not found and not self.fired:
            self.fired = True
            await self._end()

    async def xread(self, *args, **kwargs):
        found = await self._client.xread(*args, **kwargs)
        if not kwargs.get("block"):
            await self._after(found)
        return found

    def pipeline(self, *args, **kwargs):
        return _Pipeline(self, self._client.pipeline(*args, **kwargs))


class _Pipeline:
    def __init__(self, owner: _OwnerEndsAfterAnEmptyRead, pipe):
        self._owner, self._pipe, self._reads = owner, pipe, []

    def __getattr__(self, name):
        return getattr(self._pipe, name)

    async def __aenter__(self):
        await self._pipe.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._pipe.__aexit__(*exc)

    def xread(self, *args, **kwargs):
        self._reads.append(len(self._pipe.command_stack))
        return self._pipe.xread(*args, **kwargs)

    async def execute(self, *args, **kwargs):
        results = await self._pipe.execute(*args, **kwargs)
        for at in self._reads:
            await self._owner._after(results[at])
        return results


@pytest.mark.parametrize("n, max_tokens, last", [(2, 25, "y"), (1, 1, "")])
def test_an_owner_that_finishes_right_after_an_empty_read_is_followed_to_its_finish(redis_url, n, max_tokens, last):
    """``n`` = 2: its last tokens and finishes; ``n`` = 1 with all its tokens relayed: only its finish."""
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            message = _message(n, max_tokens)
            owner = StreamJournal(client, ID, 60, lease_s=60.0, owner="a")
            await owner.open(message, "key-1", 0)
            for index in range(n):
                await owner.append(link_pb2.Delta(request_id=ID, index=index, text="x", token_ids=[120]))
            _journal, point = await StreamJournal.load(client, ID, "key-1", 0, 60, lease_s=1.0, owner="b")

            async def end() -> None:  # the last step: its tokens and the finish of each choice, then the release
                for index in range(n if last else 0):
                    await owner.append(link_pb2.Delta(request_id=ID, index=index, text=last, token_ids=[121]))
                for index in range(n):
                    await owner.finish(link_pb2.Finished(request_id=ID, index=index,
                                                         finish_reason=common_pb2.FINISH_REASON_LENGTH))
                await owner.release()

            reader = _OwnerEndsAfterAnEmptyRead(client, end)
            relay = StreamRelay(reader, point.journal, point, block_ms=50)
            deltas = n * (2 if last else 1)
            got = [await asyncio.wait_for(relay.next(), 10) for _ in range(deltas + n)]
            assert reader.fired
            assert [type(e).__name__ for e in got] == ["Delta"] * deltas + ["Finished"] * n
            assert sorted(e.index for e in got if isinstance(e, link_pb2.Finished)) == list(range(n))
            assert relay.text == "x" * n + last * n
        finally:
            await client.aclose()
    asyncio.run(main())
