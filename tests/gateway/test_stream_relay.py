"""A resume while the stream's first gateway still streams it (issue 49 item 2): the resuming
gateway relays that gateway's journal instead of running the request twice; once the owner's
lease is gone it takes the stream over, exactly once (gateway/stream_relay.py,
gateway/stream_journal.py). Real gateways, real Redis, the scripted worker; the worker holds
each stream after 12 pieces (``GATED``) until the test opens its gate, so a stream is
unfinished where the test needs it to be."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from common.promtext import sample_sum
from gateway.stream_journal import RECORD_PREFIX
from protos import link_pb2
from tests.gateway.conftest import wait_for
from tests.gateway.fake_worker import GATED, GATED_PIECES
from tests.gateway.harness import start_gateway

SAID = "".join(f"{i:02d}|" for i in range(25))  # 25 pieces of 3 characters, one token each
BODY = {"model": "test-model", "messages": [{"role": "user", "content": f"{GATED}SAY[{SAID}]SAY"}],
        "max_tokens": 25, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
LEASE_S = 1.0
WAIT_S = 20.0  # generous: conditions are polled, never slept on


@pytest.fixture()
def gateways(redis_url, fake_worker):
    """Three gateways on one Redis; the first's lease is long (600 s), so a test that drops
    it by hand is not undone by the first's own refresh."""
    started = [start_gateway(redis_url, stream_owner_lease_s=600.0),
               start_gateway(redis_url, stream_owner_lease_s=LEASE_S),
               start_gateway(redis_url, stream_owner_lease_s=LEASE_S)]
    yield started
    fake_worker.gate.clear()
    for gw in started:
        if gw.thread.is_alive():
            gw.stop()


class Stream:
    """One SSE response read incrementally: ``events`` so far, ``tokens`` (its last id's offset)."""

    def __init__(self, url: str, key: str, last_event_id: str | None = None, path: str = "/v1/chat/completions",
                 body: dict = BODY):
        headers = {"Authorization": f"Bearer {key}"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self._cm = httpx.stream("POST", f"{url}{path}", json=body, headers=headers,
                                timeout=httpx.Timeout(WAIT_S, read=WAIT_S * 3))
        self.response = self._cm.__enter__()
        self._lines = self.response.iter_lines()
        self.events: list[dict] = []
        self.tokens = 0

    def read_until(self, predicate) -> None:
        """Read events until ``predicate(self)`` or the stream's end."""
        block: dict = {}
        while not predicate(self):
            line = next(self._lines, None)
            if line is None:
                return
            if line:
                name, _, value = line.partition(": ")
                block[name] = value
                continue
            if block:
                self.events.append(block)
                if "id" in block:
                    self.tokens = int(block["id"].rsplit("/", 1)[1].split(".")[0])  # a closing chunk: .k
                block = {}

    def read_all(self) -> "Stream":
        self.read_until(lambda s: bool(s.events) and s.events[-1].get("data") == "[DONE]")
        return self

    @property
    def text(self) -> str:
        chunks = [json.loads(e["data"]) for e in self.events if e.get("data", "[DONE]") != "[DONE]"]
        return "".join(c["choices"][0]["delta"].get("content") or "" if "delta" in c["choices"][0]
                       else c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))

    @property
    def request_id(self) -> str:
        return self.response.headers["x-request-id"]

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def _start(url: str, key: str, chunks: int) -> Stream:
    """A gated stream read until its client has ``chunks`` tokens (then left unread, open)."""
    stream = Stream(url, key)
    assert stream.response.status_code == 200
    stream.read_until(lambda s: s.tokens >= chunks)
    assert stream.tokens == chunks
    return stream


def _resumes(gateway, how: str) -> float:
    """``inflight_gateway_stream_resumes_total{how}`` of ``gateway``."""
    text = httpx.get(f"{gateway.rest_url}/metrics", timeout=10).text
    return sample_sum(text, "inflight_gateway_stream_resumes_total", {"how": how})


def _runs_of(fake_worker, internal_id: str) -> list:
    return [r for r in fake_worker.requests if r.request_id == internal_id]


def _internal_id(redis_url: str) -> str:
    client = redis.Redis.from_url(redis_url)
    try:
        records = [k.decode() for k in client.keys(RECORD_PREFIX + "req-*") if k.count(b":") == 2]
    finally:
        client.close()
    assert len(records) == 1, records
    return records[0][len(RECORD_PREFIX):]


def _drop_lease(redis_url: str, internal_id: str) -> None:
    """Drop the owner's lease once it journaled all it has before the gate (an append of its
    would take a lapsed lease back: nobody took the stream over yet)."""
    assert wait_for(lambda: _journaled_text(redis_url, internal_id) == SAID[:3 * GATED_PIECES], WAIT_S)
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.delete(f"{RECORD_PREFIX}{internal_id}:owner") == 1
    finally:
        client.close()


def _journaled_text(redis_url: str, internal_id: str) -> str:
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(f"{RECORD_PREFIX}{internal_id}:events")
    finally:
        client.close()
    return "".join(link_pb2.Delta.FromString(f[b"d"]).text for _, f in entries if b"d" in f)


@pytest.mark.parametrize("where", ["another gateway", "the same gateway"])
def test_a_resume_while_the_owner_streams_is_relayed(gateways, api_key, fake_worker, redis_url, where):
    """The first connection stays open, unread (a half-open client): the resume relays the
    owner's journal and follows it to the end; the worker ran the request once."""
    first = gateways[0]
    resumer = gateways[1] if where == "another gateway" else first
    original = _start(first.rest_url, api_key, 5)
    internal = _internal_id(redis_url)
    resumed = Stream(resumer.rest_url, api_key, f"{original.request_id}/5")
    try:
        assert resumed.response.status_code == 200
        resumed.read_until(lambda s: s.tokens >= GATED_PIECES)  # the journal so far
        assert resumed.tokens == GATED_PIECES
        fake_worker.gate.set()  # the owner's run goes on: its appends are relayed
        resumed.read_all()
        original.read_all()  # the owner's own client gets it all too
    finally:
        resumed.close()
        original.close()
    assert resumed.text == SAID[15:]  # nothing repeated, nothing missing
    offsets = [int(e["id"].rsplit("/", 1)[1].split(".")[0]) for e in resumed.events if "id" in e]
    assert offsets[0] == 6 and offsets == sorted(offsets) and offsets[-1] == 25
    assert json.loads(resumed.events[-2]["data"])["usage"]["completion_tokens"] == 25
    assert original.text == SAID
    assert len(_runs_of(fake_worker, internal)) == 1  # no continuation was queued
    assert _journaled_text(redis_url, internal) == SAID
    assert _resumes(resumer, "relayed") == 1 and _resumes(resumer, "taken_over") == 0


def test_the_owner_dies_while_relayed_and_the_relay_takes_over(gateways, api_key, fake_worker, redis_url):
    """The owner gateway stops while the second relays its stream: the second takes the stream
    over (at the journal's end, all of it relayed) within the lease and one continuation; the
    rest arrives exactly once."""
    first, second = gateways[0], gateways[1]
    original = _start(first.rest_url, api_key, 5)
    internal = _internal_id(redis_url)
    resumed = Stream(second.rest_url, api_key, f"{original.request_id}/5")
    try:
        resumed.read_until(lambda s: s.tokens >= GATED_PIECES)
        first.stop()  # its lease goes with it (released, or lapsed after LEASE_S)
        stopped = time.monotonic()
        assert wait_for(lambda: len(_runs_of(fake_worker, internal)) == 2, WAIT_S), "no continuation"
        took_s = time.monotonic() - stopped
        fake_worker.gate.set()
        resumed.read_all()
    finally:
        resumed.close()
        original.close()
    cont = _runs_of(fake_worker, internal)[-1]
    assert cont.reply_to == second.settings.reply_to
    assert len(cont.resumed_token_ids) == GATED_PIECES and cont.resumed_text == SAID[:3 * GATED_PIECES]
    assert resumed.text == SAID[15:]
    assert json.loads(resumed.events[-2]["data"])["usage"]["completion_tokens"] == 25
    assert _journaled_text(redis_url, internal) == SAID
    assert took_s < LEASE_S + 10, took_s
    assert _resumes(second, "relayed") == 1 and _resumes(second, "taken_over") == 1  # the lease, then one look of the relay (generous)
    print(f"took over {took_s:.2f} s after the owner stopped (lease {LEASE_S} s)")


def test_a_stale_owner_does_not_append_after_another_took_over(gateways, api_key, fake_worker, redis_url):
    """The owner's lease is gone (as if it had been stopped past it: dropped by hand here) and
    a resume took the stream over. When the owner's run goes on, its append is refused: it
    cancels its run and ends its stream with ``stream_taken_over``; the journal holds each
    token once."""
    first, second = gateways[0], gateways[1]
    original = _start(first.rest_url, api_key, 5)
    internal = _internal_id(redis_url)
    _drop_lease(redis_url, internal)
    resumed = Stream(second.rest_url, api_key, f"{original.request_id}/5")
    try:
        assert resumed.response.status_code == 200, resumed.response.read()
        assert wait_for(lambda: len(_runs_of(fake_worker, internal)) == 2, WAIT_S), "no continuation"
        cont = _runs_of(fake_worker, internal)[-1]
        # all the journal holds was relayed: the continuation goes on after it
        assert cont.reply_to == second.settings.reply_to and len(cont.resumed_token_ids) == GATED_PIECES
        fake_worker.gate.set()
        resumed.read_all()
        original.read_all()
    finally:
        resumed.close()
        original.close()
    assert resumed.text == SAID[15:], resumed.events[-3:]
    assert internal in fake_worker.cancels  # the stale owner cancelled its own run
    error = json.loads(original.events[-2]["data"])["error"]
    assert error["code"] == "stream_taken_over"
    assert original.text == SAID[:3 * len(original.text) // 3] and len(original.text) < len(SAID)
    assert _journaled_text(redis_url, internal) == SAID  # nothing of the stale owner's after the takeover
    assert _resumes(first, "lease_lost") == 1 and _resumes(second, "taken_over") == 1


def test_two_gateways_racing_to_take_over_queue_one_continuation(gateways, api_key, fake_worker, redis_url):
    """Both resumes find no owner; one takes the stream over, the other relays from it."""
    first, second, third = gateways
    original = _start(first.rest_url, api_key, 5)
    internal = _internal_id(redis_url)
    _drop_lease(redis_url, internal)
    barrier = threading.Barrier(2)

    def resume(gw, at: int) -> Stream:
        barrier.wait()
        return Stream(gw.rest_url, api_key, f"{original.request_id}/{at}")

    with ThreadPoolExecutor(2) as pool:
        streams = list(pool.map(resume, (second, third), (5, 3)))
    try:
        assert wait_for(lambda: len(_runs_of(fake_worker, internal)) >= 2, WAIT_S), "no continuation"
        fake_worker.gate.set()
        for stream in streams:
            stream.read_all()
        original.read_all()
    finally:
        for stream in (*streams, original):
            stream.close()
    assert len(_runs_of(fake_worker, internal)) == 2  # the original and exactly one continuation
    assert _resumes(second, "taken_over") + _resumes(third, "taken_over") == 1
    assert streams[0].text == SAID[15:] and streams[1].text == SAID[9:], [s.events[-3:] for s in streams]
    assert _journaled_text(redis_url, internal) == SAID


def test_a_grpc_resume_while_the_owner_streams_is_relayed(gateways, api_key, fake_worker, redis_url):
    import grpc

    from protos import common_pb2, inference_pb2, inference_pb2_grpc

    first, second = gateways[0], gateways[1]
    request = inference_pb2.GenerateRequest(
        model="test-model", chat=inference_pb2.ChatMessages(messages=[
            inference_pb2.ChatMessage(role="user", content=f"{GATED}SAY[{SAID}]SAY")]),
        sampling=common_pb2.SamplingParams(max_tokens=25))
    metadata = (("authorization", f"Bearer {api_key}"),)
    with grpc.insecure_channel(first.grpc_target) as one, grpc.insecure_channel(second.grpc_target) as two:
        call = inference_pb2_grpc.InferenceStub(one).Generate(request, metadata=metadata, timeout=WAIT_S * 3)
        got, offset = [], 0
        for response in call:  # then left unread, open
            got.append(response.text)
            offset += len(response.token_ids)
            if offset == 4:
                break
        internal = _internal_id(redis_url)
        resume = inference_pb2.ResumeRequest(request_id=response.request_id, offset=offset, request=request)
        rest, tokens = [], offset
        for response in inference_pb2_grpc.InferenceStub(two).Resume(resume, metadata=metadata,
                                                                     timeout=WAIT_S * 3):
            rest.append(response)
            tokens += len(response.token_ids)
            if tokens == GATED_PIECES:
                fake_worker.gate.set()
        call.cancel()
    assert "".join(got) + "".join(r.text for r in rest) == SAID
    assert rest[-1].usage.completion_tokens == 25
    assert len(_runs_of(fake_worker, internal)) == 1


def test_a_completions_resume_while_the_owner_streams_is_relayed(gateways, api_key, fake_worker, redis_url):
    body = {"model": "test-model", "prompt": f"{GATED}SAY[{SAID}]SAY", "max_tokens": 25, "stream": True}
    first, second = gateways[0], gateways[1]
    original = Stream(first.rest_url, api_key, path="/v1/completions", body=body)
    original.read_until(lambda s: s.tokens >= 3)
    internal = _internal_id(redis_url)
    resumed = Stream(second.rest_url, api_key, f"{original.request_id}/3", "/v1/completions", body)
    try:
        resumed.read_until(lambda s: s.tokens >= GATED_PIECES)
        fake_worker.gate.set()
        resumed.read_all()
    finally:
        resumed.close()
        original.close()
    assert resumed.text == SAID[9:]
    assert len(_runs_of(fake_worker, internal)) == 1


def _by_choice(events: list[dict]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        if e.get("data", "[DONE]") == "[DONE]":
            continue
        for choice in json.loads(e["data"]).get("choices") or []:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    return texts


def test_a_stream_with_two_choices_is_relayed_while_its_owner_streams(gateways, api_key, fake_worker, redis_url):
    """``n`` > 1 cannot be continued part way, but a relay needs no continuation."""
    body = {**BODY, "n": 2}
    first, second = gateways[0], gateways[1]
    original = Stream(first.rest_url, api_key, body=body)
    original.read_until(lambda s: s.tokens >= 6)
    at = original.tokens
    internal = _internal_id(redis_url)
    resumed = Stream(second.rest_url, api_key, f"{original.request_id}/{at}", body=body)
    try:
        resumed.read_until(lambda s: s.tokens >= 2 * GATED_PIECES)
        fake_worker.gate.set()
        resumed.read_all()
    finally:
        resumed.close()
        original.close()
    before, after = _by_choice(original.events), _by_choice(resumed.events)
    assert {i: before.get(i, "") + after.get(i, "") for i in (0, 1)} == {0: SAID, 1: SAID}
    finishes = [c["finish_reason"] for e in resumed.events if e.get("data", "[DONE]") != "[DONE]"
                for c in json.loads(e["data"]).get("choices") or [] if c.get("finish_reason")]
    assert len(finishes) == 2
    assert len(_runs_of(fake_worker, internal)) == 1


def _lease_held(redis_url: str, internal_id: str) -> bool:
    client = redis.Redis.from_url(redis_url)
    try:
        return bool(client.exists(f"{RECORD_PREFIX}{internal_id}:owner"))
    finally:
        client.close()


def test_the_lease_is_released_when_the_stream_ends_or_its_client_leaves(gateways, api_key, fake_worker,
                                                                         redis_url):
    """Finished: no lease left. A client gone: its run is cancelled and the lease released at
    once (the first gateway's lease is 600 s: only a release can end it), so a resume takes
    over without waiting for it."""
    first = gateways[0]
    fake_worker.gate.set()
    done = Stream(first.rest_url, api_key).read_all()
    done.close()
    internal = _internal_id(redis_url)
    assert done.text == SAID and not _lease_held(redis_url, internal)
    client = redis.Redis.from_url(redis_url)
    client.delete(*client.keys(RECORD_PREFIX + "*"))
    client.close()

    fake_worker.gate.clear()
    left = _start(first.rest_url, api_key, 3)
    internal = _internal_id(redis_url)
    assert _lease_held(redis_url, internal)
    left.close()
    assert wait_for(lambda: internal in fake_worker.cancels, WAIT_S)
    assert wait_for(lambda: not _lease_held(redis_url, internal), WAIT_S)


def test_a_stream_whose_client_left_is_taken_over_on_the_same_gateway(gateways, api_key, fake_worker,
                                                                        redis_url):
    """Its client left, so the gateway cancelled the run and released the lease; a resume
    through that same gateway takes the stream over and the worker runs its continuation (a
    newer attempt, queued after the cancel): the remembered cancel binds the first run only
    (it used to drop the continuation, and the resume waited for nothing)."""
    first = gateways[0]
    left = _start(first.rest_url, api_key, 3)
    internal = _internal_id(redis_url)
    left.close()
    assert wait_for(lambda: internal in fake_worker.cancels, WAIT_S)
    assert wait_for(lambda: not _lease_held(redis_url, internal), WAIT_S)
    fake_worker.gate.set()
    for _ in range(3):  # a 503 says retry: a loaded machine's Redis may miss the key lookup's 0.5 s
        resumed = Stream(first.rest_url, api_key, f"{left.request_id}/3")
        if resumed.response.status_code != 503:
            break
        resumed.close()
    try:
        assert resumed.response.status_code == 200
        resumed.read_all()
    finally:
        resumed.close()
    assert resumed.text == SAID[9:]
    runs = _runs_of(fake_worker, internal)
    assert [r.attempt for r in runs] == [0, 64] and runs[1].reply_to == runs[0].reply_to


def test_no_lease_task_is_left_after_the_gateway_shuts_down(redis_url, api_key, fake_worker):
    """A gateway stopped while a stream holds its lease (a long one: its keeper sleeps between
    refreshes) ends the keeper's task at shutdown instead of leaving it pending on its loop."""
    gateway = start_gateway(redis_url, stream_owner_lease_s=600.0)
    stream = None
    try:
        stream = _start(gateway.rest_url, api_key, 3)
        assert _lease_held(redis_url, _internal_id(redis_url))
    finally:
        gateway.stop()
        if stream is not None:
            stream.close()
    assert not gateway.thread.is_alive()
    left = [t for t in asyncio.all_tasks(gateway.loop) if "LeaseKeeper" in repr(t.get_coro())]
    assert not left, left
