"""Streams that survive their gateway (issue 49 item 2, gateway/stream_journal.py), and
streams nobody reads (item 1's slow reader): against real gateways, real Redis and the
scripted worker, with the real ``openai`` client for the first part of a stream and a raw
SSE reconnect (httpx, ``Last-Event-ID``) for its rest."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
import redis

from gateway import keys
from tests.gateway.conftest import wait_for
from tests.gateway.fake_worker import GATED
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import start_redis
from tests.helpers.sse import sse_events

SAID = "".join(f"{i:02d}|" for i in range(25))  # 25 pieces of 3 characters
BODY = {"model": "test-model", "messages": [{"role": "user", "content": f"SAY[{SAID}]SAY"}],
        "max_tokens": 25, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
LEASE_S = 1.0  # the gateways' owner lease (stream_owner_lease_s): short, so a takeover is quick


@pytest.fixture()
def two_gateways(redis_url, fake_worker):
    first, second = (start_gateway(redis_url, stream_owner_lease_s=LEASE_S) for _ in range(2))
    yield first, second
    for gw in (first, second):
        if gw.thread.is_alive():  # the first one may have been stopped by the test
            gw.stop()


def _resume(gateway, key: str, last_event_id: str, body: dict = BODY) -> httpx.Response:
    return httpx.post(f"{gateway.rest_url}/v1/chat/completions", json=body, timeout=20,
                      headers={"Authorization": f"Bearer {key}", "Last-Event-ID": last_event_id})


def _text(events: list[dict]) -> str:
    chunks = [json.loads(e["data"]) for e in events if e.get("data", "[DONE]") != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_stream_broken_by_its_gateways_death_resumes_through_another(two_gateways, api_key, fake_worker):
    """The worker holds the stream after 12 pieces (``GATED``, tests/gateway/fake_worker.py) until the first gateway is gone,
    so the stream is unfinished there and the resume continues it on a worker."""
    first, second = two_gateways
    body = {**BODY, "messages": [{"role": "user", "content": f"{GATED}SAY[{SAID}]SAY"}]}
    client = openai.OpenAI(base_url=f"{first.rest_url}/v1", api_key=api_key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(**{k: v for k, v in body.items() if k != "model"},
                                                             model="test-model")
    request_id = raw.headers["x-request-id"]
    got, offset = [], 0
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            got.append(chunk.choices[0].delta.content)
        offset = chunk.usage.completion_tokens  # continuous usage: the offset of the chunk's SSE id
        if len(got) == 10:
            break
    first.stop()  # the gateway dies with the stream open; its worker drops the run
    fake_worker.gate.set()
    try:
        r = _resume(second, api_key, f"{request_id}/{offset}", body)
    finally:
        fake_worker.gate.clear()
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1]["data"] == "[DONE]"
    # every chunk carries its offset, counting on from the one the client had
    offsets = [_offset(e["id"]) for e in events if "id" in e]
    assert offsets[0] == offset + 1 and offsets == sorted(offsets)
    assert "".join(got) + _text(events) == SAID  # nothing repeated, nothing missing
    last = json.loads(events[-2]["data"])
    assert last["usage"]["completion_tokens"] == len(SAID) // 3
    cont = fake_worker.requests[-1]
    # The stopped gateway's lease either went with it (the journal cut at the client's offset)
    # or lapsed while the second relayed the journal (continued after all of it).
    assert cont.reply_to == second.settings.reply_to and len(cont.resumed_token_ids) >= offset
    assert cont.resumed_text == SAID[:3 * len(cont.resumed_token_ids)]

    # a second break of the resumed stream resumes again, from the journal the second gateway kept
    mid = [e for e in events if "id" in e][5]["id"]
    again = _resume(second, api_key, mid, body)  # finished: replayed from the journal
    assert again.status_code == 200, again.text
    assert _text(sse_events(again.text)) == SAID[int(mid.rsplit("/", 1)[1]) * 3:]


def test_a_resume_is_refused_clearly(two_gateways, api_key, redis_url):
    first, second = two_gateways
    r = httpx.post(f"{first.rest_url}/v1/chat/completions", json=BODY, timeout=20,
                   headers={"Authorization": f"Bearer {api_key}"})
    request_id = r.headers["x-request-id"]
    assert r.status_code == 200
    client = redis.Redis.from_url(redis_url)
    _, other_key = keys.create_key(client, "tenant-b", "other")
    client.close()
    cases = [(api_key, "no-slash", 400, "invalid_last_event_id"),
             (api_key, "req-unknown/3", 404, "stream_not_found"),
             (other_key, f"{request_id}/3", 404, "stream_not_found"),  # another key's stream
             (api_key, f"{request_id}/999", 400, "not_resumable"),  # past the stream's end
             (api_key, f"{request_id}/3.1", 400, "invalid_last_event_id")]  # a closing id where no stream ended
    for key, last_id, status, code in cases:
        got = _resume(second, key, last_id)
        assert got.status_code == status, (last_id, got.text)
        assert got.json()["error"]["code"] == code
    other_body = {**BODY, "messages": [{"role": "user", "content": "something else"}]}
    got = _resume(second, api_key, f"{request_id}/3", other_body)
    assert got.status_code == 400 and got.json()["error"]["code"] == "resume_mismatch"


def _unread_stream_cancelled_after(**settings) -> float:
    """Seconds from sending a streamed request that is never read to the worker's Cancel
    for it. A Redis and a scripted worker of its own, stepping every millisecond (each step a
    4,000-character piece), so the socket's buffers (a few MB on loopback) fill in seconds."""
    from tests.gateway.fake_worker import FakeWorker

    server = start_redis()
    worker = FakeWorker(server.url, worker_id="fast-1", step_s=0.001).start()
    gateway = start_gateway(server.url, **settings)
    sock = socket.socket()
    try:
        client = redis.Redis.from_url(server.url)
        _, api_key = keys.create_key(client, "tenant-a", "test")
        client.close()
        body = json.dumps({"model": "test-model", "prompt": "flood", "max_tokens": 100,
                           "stream": True}).encode()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", gateway.settings.rest_port))
        seen = len(worker.accepted)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        started = time.monotonic()
        assert wait_for(lambda: len(worker.accepted) > seen, 10)
        rid = worker.accepted[-1]
        assert wait_for(lambda: rid in worker.cancels, 15), "the unread stream was never cancelled"
        return time.monotonic() - started
    finally:
        sock.close()
        gateway.stop()
        worker.stop()
        server.stop()


def test_a_stream_nobody_reads_is_cancelled_after_the_idle_timeout():
    """Once the socket's buffers are full the gateway's send waits; after
    ``stream_idle_timeout_s`` the stream is cancelled and the worker told, so the sequence
    stops generating for nobody (the per-stream buffer bound is out of the way here)."""
    after = _unread_stream_cancelled_after(stream_idle_timeout_s=1.0,
                                           stream_buffer_events=10**9)
    assert after > 1.0, after  # not before its limit


def test_a_reader_that_falls_behind_is_cancelled_at_the_buffer_bound():
    """The deltas a stream holds unread in the gateway are bounded (``stream_buffer_events``):
    past the bound the stream is cancelled long before the idle timeout."""
    after = _unread_stream_cancelled_after(stream_idle_timeout_s=1000.0,
                                           stream_buffer_events=64)
    assert after < 10.0, after


def test_a_grpc_stream_resumes_through_another_gateway_with_the_same_key(two_gateways, api_key, redis_url):
    """The first stream's client leaves first (its gateway sends the worker a Cancel), then
    the gateway stops: the Cancel binds that gateway's run only, not the resumed one."""
    import grpc

    from protos import common_pb2, inference_pb2, inference_pb2_grpc

    first, second = two_gateways
    request = inference_pb2.GenerateRequest(
        model="test-model", chat=inference_pb2.ChatMessages(messages=[
            inference_pb2.ChatMessage(role="user", content=f"SAY[{SAID}]SAY")]),
        sampling=common_pb2.SamplingParams(max_tokens=25))
    metadata = (("authorization", f"Bearer {api_key}"),)
    got, offset, request_id = [], 0, ""
    with grpc.insecure_channel(first.grpc_target) as channel:
        for response in inference_pb2_grpc.InferenceStub(channel).Generate(request, metadata=metadata, timeout=10):
            got.append(response.text)
            offset += len(response.token_ids)
            request_id = response.request_id
            if len(got) == 6:
                break
    first.stop()
    client = redis.Redis.from_url(redis_url)
    _, other_key = keys.create_key(client, "tenant-b", "other")
    client.close()
    with grpc.insecure_channel(second.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        resume = inference_pb2.ResumeRequest(request_id=request_id, offset=offset, request=request)
        with pytest.raises(grpc.RpcError) as refused:  # another key's stream does not exist for it
            list(stub.Resume(resume, metadata=(("authorization", f"Bearer {other_key}"),), timeout=10))
        assert refused.value.code() is grpc.StatusCode.NOT_FOUND
        rest = list(stub.Resume(resume, metadata=metadata, timeout=10))
    assert "".join(got) + "".join(r.text for r in rest) == SAID
    assert rest[-1].usage.completion_tokens == len(SAID) // 3 and {r.request_id for r in rest} == {request_id}


SAY_OK = {"model": "test-model", "messages": [{"role": "user", "content": "Say OK"}], "max_tokens": 60,
          "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _offset(event_id: str) -> int:
    """The output tokens of an ``id:`` (``<request id>/<offset>``, a closing chunk's
    ``<request id>/<offset>.<k>``)."""
    return int(event_id.rsplit("/", 1)[1].split(".")[0])


def _chunks(events: list[dict]) -> list[dict]:
    return [json.loads(e["data"]) for e in events if e.get("data", "[DONE]") != "[DONE]"]


def test_a_finished_stream_resumed_at_its_end_gets_only_its_finish(gateway, api_key, fake_worker):
    """A client that lost only the last chunk(s) or ``[DONE]``: the journal recorded the finish,
    so the resume answers it (and the usage) from the journal and generates nothing; a resume
    further back replays the journal's own text."""
    r = httpx.post(f"{gateway.rest_url}/v1/chat/completions", json=SAY_OK, timeout=20,
                   headers={"Authorization": f"Bearer {api_key}"})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    first = _chunks(events)
    assert first[-2]["choices"][0]["finish_reason"] == "stop"
    rid = r.headers["x-request-id"]
    # the finish and the usage chunk follow the last delta: ids of their own
    assert [e.get("id") for e in events[-3:]] == [f"{rid}/5.1", f"{rid}/5.2", None]
    last_id = events[-4]["id"]
    assert last_id == f"{rid}/5"
    queued = len(fake_worker.requests)

    end = _resume(gateway, api_key, last_id, SAY_OK)
    assert end.status_code == 200, end.text
    got = sse_events(end.text)
    chunks = _chunks(got)
    assert got[-1]["data"] == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == ["stop"]
    assert _text(got) == ""  # no new text after the end of turn
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == first[-1]["usage"]
    assert [e.get("id") for e in got] == [f"{rid}/5.1", f"{rid}/5.2", None]
    assert chunks[0]["id"] == first[0]["id"] and chunks[0]["created"] == first[0]["created"]
    back = _resume(gateway, api_key, f"{rid}/2", SAY_OK)
    assert back.status_code == 200, back.text
    assert _text(sse_events(back.text)) == "w2 w3 w4 "
    assert len(fake_worker.requests) == queued  # nothing was queued for either resume


def test_a_grpc_resume_of_a_finished_stream_gets_only_its_finish(gateway, api_key, fake_worker):
    import grpc

    from protos import common_pb2, inference_pb2, inference_pb2_grpc

    request = inference_pb2.GenerateRequest(
        model="test-model", chat=inference_pb2.ChatMessages(messages=[
            inference_pb2.ChatMessage(role="user", content="Say OK")]),
        sampling=common_pb2.SamplingParams(max_tokens=60))
    metadata = (("authorization", f"Bearer {api_key}"),)
    with grpc.insecure_channel(gateway.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        whole = list(stub.Generate(request, metadata=metadata, timeout=10))
        offset = sum(len(r.token_ids) for r in whole)
        queued = len(fake_worker.requests)
        resume = inference_pb2.ResumeRequest(request_id=whole[-1].request_id, offset=offset, request=request)
        rest = list(stub.Resume(resume, metadata=metadata, timeout=10))
    assert [(r.text, r.finish_reason) for r in rest] == [("", common_pb2.FINISH_REASON_STOP)]
    assert rest[0].usage == whole[-1].usage and rest[0].request_id == whole[-1].request_id
    assert len(fake_worker.requests) == queued


def test_a_stream_resumes_by_the_clients_own_x_request_id(gateway, api_key, redis_url):
    """The ``x-request-id`` the client sent is the one of the SSE ids, and resuming by it (as
    docs/API.md builds ``Last-Event-ID`` from the header) finds the stream, for its key only."""
    r = httpx.post(f"{gateway.rest_url}/v1/chat/completions", json=BODY, timeout=20,
                   headers={"Authorization": f"Bearer {api_key}", "X-Request-Id": "my-req-43"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-req-43"
    events = sse_events(r.text)
    assert {e["id"].rsplit("/", 1)[0] for e in events if "id" in e} == {"my-req-43"}
    got = _resume(gateway, api_key, "my-req-43/3")
    assert got.status_code == 200, got.text
    assert _text(sse_events(got.text)) == SAID[9:]
    client = redis.Redis.from_url(redis_url)
    _, other_key = keys.create_key(client, "tenant-b", "other")
    client.close()
    other = _resume(gateway, other_key, "my-req-43/3")
    assert other.status_code == 404 and other.json()["error"]["code"] == "stream_not_found"


@pytest.mark.parametrize("last_id", [b"abc/\xb2", b"abc/\xd9\xa3", b"abc/" + b"9" * 5000, b"abc/" + b"9" * 11,
                                     b"x" * 200 + b"/3", b"abc/-1", b"/3"])
def test_a_malformed_last_event_id_is_a_400(gateway, api_key, last_id):
    r = httpx.post(f"{gateway.rest_url}/v1/chat/completions", json=BODY, timeout=20,
                   headers={"Authorization": f"Bearer {api_key}", "Last-Event-ID": last_id})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_last_event_id" and error["type"] == "invalid_request_error"
    assert error["param"] == "Last-Event-ID" and len(error["message"]) < 400


def test_a_resume_with_another_model_is_refused(gateway, api_key, redis_url):
    """``other`` names the same model (an alias a worker announces), so the prompt's tokens are
    the same: the resume is still another request's, whose chunks would carry another model."""
    client = redis.Redis.from_url(redis_url)
    client.set("inflight:workers:alias-1", json.dumps({
        "model": "test-model", "served_model_names": ["test-model", "other"], "batching": "continuous",
        "started": time.time()}), ex=30)
    client.close()
    r = httpx.post(f"{gateway.rest_url}/v1/chat/completions", json=BODY, timeout=20,
                   headers={"Authorization": f"Bearer {api_key}"})
    assert r.status_code == 200
    other = {**BODY, "model": "other"}
    quiet = {**other, "stream": False, "stream_options": None}
    assert httpx.post(f"{gateway.rest_url}/v1/chat/completions", json=quiet, timeout=20,
                      headers={"Authorization": f"Bearer {api_key}"}).status_code == 200  # "other" is served
    got = _resume(gateway, api_key, f"{r.headers['x-request-id']}/3", other)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["code"] == "resume_mismatch" and got.json()["error"]["param"] == "model"


def test_a_finished_stream_with_two_choices_resumes_at_its_end(gateway, api_key, fake_worker):
    """A finished stream is replayed from its journal, so ``n`` > 1 (refused part way through
    a running stream) resumes too: at its end, each choice's finish chunk and the usage."""
    body = {**SAY_OK, "n": 2}
    r = httpx.post(f"{gateway.rest_url}/v1/chat/completions", json=body, timeout=20,
                   headers={"Authorization": f"Bearer {api_key}"})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    first = _chunks(events)
    last_id = [e["id"] for e in events if "id" in e and "." not in e["id"]][-1]  # the last delta's
    queued = len(fake_worker.requests)
    got = _resume(gateway, api_key, last_id, body)
    assert got.status_code == 200, got.text
    chunks = _chunks(sse_events(got.text))
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks if c["choices"]}
    assert finishes == {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                        for c in first if c["choices"] and c["choices"][0]["finish_reason"]}
    assert len(finishes) == 2 and chunks[-1]["usage"] == first[-1]["usage"]
    assert len(fake_worker.requests) == queued


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_finished_stream_resumes_at_each_of_its_ids_closing_ones_included(gateway, api_key, fake_worker,
                                                                          path, n):
    """Every chunk after the last delta (each choice's finish, the usage chunk) has an id of
    its own, ``<request id>/<offset>.<k>``: broken after each id, the client's chunks and the
    resume's are the unbroken stream's, chunk for chunk, none twice (n = 2: choice 1 ends a
    step before choice 0, its finish chunk still comes after the last delta). ``.<k>`` where
    the stream did not end, and garbage after the offset, are the header's 400."""
    body = {"model": "test-model", "max_tokens": 60, "n": n, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": n > 1},
            **({"messages": [{"role": "user", "content": "Say OK"}]} if "chat" in path else {"prompt": "Say OK"})}
    headers = {"Authorization": f"Bearer {api_key}"}
    r = httpx.post(f"{gateway.rest_url}{path}", json=body, timeout=20, headers=headers)
    assert r.status_code == 200, r.text
    rid, events = r.headers["x-request-id"], sse_events(r.text)
    assert events[-1] == {"data": "[DONE]"}  # [DONE] has no id
    closing = min(i for i, e in enumerate(events) if "." in e.get("id", "."))
    offset = _offset(events[-2]["id"])
    assert [e["id"] for e in events[closing:-1]] == [f"{rid}/{offset}.{k}" for k in range(1, n + 2)]
    finishes = [c["choices"][0]["index"] for c in _chunks(events) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == list(range(n)) and all(_offset(e["id"]) <= offset for e in events[:closing])
    queued = len(fake_worker.requests)
    for last_id in dict.fromkeys(e["id"] for e in events[:-1]):
        got = httpx.post(f"{gateway.rest_url}{path}", json=body, timeout=20,
                         headers={**headers, "Last-Event-ID": last_id})
        assert got.status_code == 200, (last_id, got.text)
        had = 1 + max(i for i, e in enumerate(events) if e.get("id") == last_id)
        rest = sse_events(got.text)
        assert [e.get("id") for e in events[:had] + rest] == [e.get("id") for e in events], last_id
        assert _chunks(events[:had] + rest) == _chunks(events), last_id
    assert len(fake_worker.requests) == queued  # all replayed from the journal
    for bad in (f"{offset - 1}.1", f"{offset}.", f"{offset}.0", f"{offset}.01", f"{offset}.x",
                f"{offset}.1.2", f"{offset}.12345", f"{offset}..1"):
        got = httpx.post(f"{gateway.rest_url}{path}", json=body, timeout=20,
                         headers={**headers, "Last-Event-ID": f"{rid}/{bad}"})
        assert got.status_code == 400 and got.json()["error"]["code"] == "invalid_last_event_id", (bad, got.text)
