"""Streams of the agent APIs that survive their gateway (issue 49 item 2): ``/v1/responses``
and ``/v1/messages`` with ``stream: true`` resume through ``Last-Event-ID`` as chat's do.
Real gateways, real Redis, the scripted worker (its gate holds a stream after 12 pieces);
the first part of a stream is read raw (its ``id:`` lines), the rest through the real
``openai`` / ``anthropic`` clients (``extra_headers`` carries ``Last-Event-ID``), so the
resumed events are ones the SDKs' event models accept."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
import redis

from gateway import keys
from tests.gateway.fake_tokenizer import CharTokenizer
from tests.gateway.fake_worker import GATED, GATED_PIECES
from tests.gateway.harness import start_gateway
from tests.gateway.test_stream_relay import _internal_id, _runs_of

SAID = "".join(f"{i:02d}|" for i in range(25))  # 25 pieces of 3 characters, one token each
PROMPT = f"{GATED}SAY[{SAID}]SAY"
MODEL = "test-model"
LEASE_S = 1.0
WAIT_S = 20.0
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

RESPONSES = {"path": "/v1/responses",
             "body": {"model": MODEL, "input": PROMPT, "max_output_tokens": 30, "stream": True}}
MESSAGES = {"path": "/v1/messages",
            "body": {"model": MODEL, "max_tokens": 30, "stream": True,
                     "messages": [{"role": "user", "content": PROMPT}]}}
APIS = {"responses": RESPONSES, "messages": MESSAGES}


@pytest.fixture()
def gateways(redis_url, fake_worker):
    """The first gateway's lease is long (600 s: only its release or death ends it), the
    others' short; Qwen3's reasoning parser (an output that does not open with <think> is
    all answer)."""
    tokenizer = CharTokenizer(context_length=4096)  # room for a tool prompt
    started = [start_gateway(redis_url, tokenizer=tokenizer, stream_owner_lease_s=600.0, reasoning_parser="qwen3"),
               start_gateway(redis_url, tokenizer=tokenizer, stream_owner_lease_s=LEASE_S, reasoning_parser="qwen3")]
    yield started
    fake_worker.gate.clear()
    for gw in started:
        if gw.thread.is_alive():
            gw.stop()


class RawStream:
    """An SSE response read incrementally: its events (``event``, ``data`` parsed, ``id``)
    and the offset of its last ``id:``."""

    def __init__(self, url: str, key: str, api: dict, last_event_id: str | None = None):
        headers = {"Authorization": f"Bearer {key}"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self._cm = httpx.stream("POST", url + api["path"], json=api["body"], headers=headers,
                                timeout=httpx.Timeout(WAIT_S, read=WAIT_S * 3))
        self.response = self._cm.__enter__()
        self._lines = self.response.iter_lines()
        self.events: list[dict] = []
        self.tokens = 0
        self.ended = False

    def read_until(self, predicate) -> "RawStream":
        block: dict = {}
        while not predicate(self):
            line = next(self._lines, None)
            if line is None:
                self.ended = True
                return self
            if line:
                name, _, value = line.partition(": ")
                block[name] = json.loads(value) if name == "data" else value
                continue
            if block:
                self.events.append(block)
                if "id" in block:
                    self.tokens = _offset(block["id"])
                block = {}
        return self

    def read_all(self) -> "RawStream":
        return self.read_until(lambda s: s.ended)

    @property
    def request_id(self) -> str:
        return self.response.headers["x-request-id"]

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def _text(kind: str, events: list[dict]) -> str:
    """The output text of (raw or SDK) events of ``kind``'s API."""
    data = [e["data"] if "data" in e else e for e in events]
    if kind == "responses":
        return "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    return "".join(d["delta"]["text"] for d in data
                   if d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta")


def _resume_with_sdk(kind: str, gateway, key: str, last_event_id: str) -> list[dict]:
    """The rest of the stream through the API's own client: its parsed events, as dicts."""
    headers = {"Last-Event-ID": last_event_id}
    if kind == "responses":
        client = openai.OpenAI(base_url=gateway.rest_url + "/v1", api_key=key, max_retries=0, timeout=WAIT_S * 3)
        body = {k: v for k, v in RESPONSES["body"].items() if k != "stream"}
        events = list(client.responses.create(**body, stream=True, extra_headers=headers))
    else:
        client = anthropic.Anthropic(base_url=gateway.rest_url, api_key=key, max_retries=0, timeout=WAIT_S * 3)
        body = {k: v for k, v in MESSAGES["body"].items() if k != "stream"}
        events = list(client.messages.create(**body, stream=True, extra_headers=headers))
    return [e.model_dump(mode="json") for e in events]


def _unbroken(kind: str, gateway, key: str, fake_worker) -> RawStream:
    fake_worker.gate.set()
    try:
        stream = RawStream(gateway.rest_url, key, APIS[kind]).read_all()
    finally:
        fake_worker.gate.clear()
    stream.close()
    _forget_journals(gateway.settings.redis_url)
    return stream


def _forget_journals(redis_url: str) -> None:
    """Drop the streams' journals (a test finds its stream's as the only one)."""
    client = redis.Redis.from_url(redis_url)
    try:
        found = client.keys("inflight:resume:*")
        if found:
            client.delete(*found)
    finally:
        client.close()


def _check_closing(kind: str, before: list[dict], after: list[dict], whole: RawStream) -> None:
    """The joined events are the unbroken run's: same types in the same order, the same text,
    sequence numbers 0.. with no repeat or gap, the same item ids, the closing usage right."""
    joined = [e["data"] for e in before] + after
    unbroken = [e["data"] for e in whole.events]
    assert [d["type"] for d in joined] == [d["type"] for d in unbroken]
    assert _text(kind, joined) == _text(kind, unbroken) == SAID
    if kind == "responses":
        assert [d["sequence_number"] for d in joined] == list(range(len(joined)))
        ids = {d["item_id"] for d in joined if "item_id" in d}
        assert len(ids) == 1  # the rest continues the message the client has
        completed = joined[-1]["response"]
        assert joined[-1]["type"] == "response.completed" and completed["status"] == "completed"
        assert completed["usage"]["output_tokens"] == 25
        assert completed["output"][0]["content"][0]["text"] == SAID
        assert completed["id"] == joined[0]["response"]["id"]
    else:
        assert joined[-1]["type"] == "message_stop"
        delta = joined[-2]
        assert delta["type"] == "message_delta" and delta["usage"]["output_tokens"] == 25
        assert delta["delta"]["stop_reason"] == "end_turn"
        assert {d["index"] for d in joined if d["type"].startswith("content_block")} == {0}


@pytest.mark.parametrize("kind", ["responses", "messages"])
def test_a_stream_broken_with_its_gateway_resumes_on_another(gateways, api_key, fake_worker, redis_url, kind):
    """Broken at 5 tokens when its gateway stops; the rest comes through the other gateway
    (the journal relayed, then taken over: one continuation), equal to an unbroken run."""
    first, second = gateways
    whole = _unbroken(kind, first, api_key, fake_worker)
    original = RawStream(first.rest_url, api_key, APIS[kind]).read_until(lambda s: s.tokens >= 5)
    assert original.response.status_code == 200 and original.tokens == 5
    assert all("id" in e for e in original.events)
    internal = _internal_id(redis_url)
    first.stop()
    fake_worker.gate.set()
    try:
        rest = _resume_with_sdk(kind, second, api_key, f"{original.request_id}/5")
    finally:
        original.close()
    _check_closing(kind, original.events, rest, whole)
    assert len(_runs_of(fake_worker, internal)) == 2  # the run, then one continuation
    assert _runs_of(fake_worker, internal)[-1].reply_to == second.settings.reply_to


@pytest.mark.parametrize("kind", ["responses", "messages"])
def test_a_resume_while_the_owner_streams_is_relayed(gateways, api_key, fake_worker, redis_url, kind):
    """The first connection stays open, unread: the resume relays the owner's journal and
    follows it to the end; the worker ran the request once."""
    first, second = gateways
    whole = _unbroken(kind, first, api_key, fake_worker)
    original = RawStream(first.rest_url, api_key, APIS[kind]).read_until(lambda s: s.tokens >= 5)
    internal = _internal_id(redis_url)
    resumed = RawStream(second.rest_url, api_key, APIS[kind], f"{original.request_id}/5")
    try:
        assert resumed.response.status_code == 200
        resumed.read_until(lambda s: s.tokens >= GATED_PIECES)
        assert resumed.tokens == GATED_PIECES
        fake_worker.gate.set()
        resumed.read_all()
        original.read_all()
    finally:
        resumed.close()
        original.close()
    _check_closing(kind, original.events[:_upto(original, 5)], [e["data"] for e in resumed.events], whole)
    offsets = [_offset(e["id"]) for e in resumed.events]
    assert offsets[0] == 6 and offsets == sorted(offsets) and offsets[-1] == 25
    assert len(_runs_of(fake_worker, internal)) == 1


def _upto(stream: RawStream, offset: int) -> int:
    """How many of ``stream``'s events a client that stopped at ``offset`` had."""
    return max(i + 1 for i, e in enumerate(stream.events) if _offset(e["id"]) <= offset)


def _offset(event_id: str) -> int:
    """The output tokens of an ``id:`` (``<request id>/<offset>`` or a closing event's
    ``<request id>/<offset>.<k>``)."""
    return int(event_id.rsplit("/", 1)[1].split(".")[0])


def _refusal(kind: str, response: httpx.Response) -> tuple[int, str]:
    """``(status, code or Anthropic type)`` of an error response, in the API's own shape."""
    body = response.json()
    if kind == "messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return response.status_code, body["error"]["type"]
    return response.status_code, body["error"]["code"]


@pytest.mark.parametrize("kind", ["responses", "messages"])
def test_a_resume_is_refused_in_the_apis_own_shape(gateways, api_key, fake_worker, redis_url, kind):
    first, second = gateways
    fake_worker.gate.set()
    done = RawStream(first.rest_url, api_key, APIS[kind]).read_all()
    done.close()
    client = redis.Redis.from_url(redis_url)
    _, other_key = keys.create_key(client, "tenant-b", "other")
    client.close()
    api = APIS[kind]

    def resume(key: str, last_id: str, body: dict = api["body"]) -> httpx.Response:
        return httpx.post(second.rest_url + api["path"], json=body, timeout=WAIT_S,
                          headers={"Authorization": f"Bearer {key}", "Last-Event-ID": last_id})

    bad_request = "invalid_request_error" if kind == "messages" else None
    not_found = "not_found_error" if kind == "messages" else "stream_not_found"
    cases = [(api_key, "no-slash", 400, bad_request or "invalid_last_event_id"),
             (api_key, "req-unknown/3", 404, not_found),
             (other_key, f"{done.request_id}/3", 404, not_found),
             (api_key, f"{done.request_id}/999", 400, bad_request or "not_resumable")]
    for key, last_id, status, code in cases:
        assert _refusal(kind, resume(key, last_id)) == (status, code), last_id
    other = json.loads(json.dumps(api["body"]).replace("SAY[", "Say something else SAY["))
    got = resume(api_key, f"{done.request_id}/3", other)
    assert _refusal(kind, got) == (400, bad_request or "resume_mismatch")
    if kind == "responses":
        assert got.json()["error"]["param"] == "input"  # the Responses field, not chat's messages
    else:
        assert "resend the same body" in got.json()["error"]["message"]
    # another model: the model check comes first (this gateway serves only one), in the API's shape
    got = resume(api_key, f"{done.request_id}/3", {**api["body"], "model": "another-model"})
    assert _refusal(kind, got) == (404, "not_found_error" if kind == "messages" else "model_not_found")
    # a finished stream's resume at its last delta's id answers only its closing events,
    # at its last closing event's id nothing
    last = next(e["id"] for e in reversed(done.events) if "." not in e["id"].rsplit("/", 1)[1])
    rest = resume(api_key, last)
    assert rest.status_code == 200
    kinds = [line.split(": ", 1)[1] for line in rest.text.splitlines() if line.startswith("event: ")]
    assert kinds[-1] == ("response.completed" if kind == "responses" else "message_stop")
    assert "delta" not in "".join(k for k in kinds if k != "message_delta")
    rest = resume(api_key, done.events[-1]["id"])
    assert rest.status_code == 200 and "event: " not in rest.text
    # a closing id's form anywhere else, or garbage after the offset: the header's 400
    offset = _offset(done.events[-1]["id"])
    for bad in (f"{offset}.", f"{offset}.0", f"{offset}.01", f"{offset}.x", f"{offset}.1.2",
                f"{offset}.12345", f"{offset}..1", "3.1"):
        got = resume(api_key, f"{done.request_id}/{bad}")
        assert _refusal(kind, got) == (400, bad_request or "invalid_last_event_id"), bad


@pytest.mark.parametrize("kind", ["responses", "messages"])
def test_a_stream_with_a_tool_call_resumes_at_each_of_its_ids(gateways, api_key, fake_worker, kind):
    """Thinking, text, then a call: resumed (replayed: it finished) on the other gateway at each of its
    ids, the events the client had and the rest are exactly the stream's, byte for byte in
    JSON: the same sequence numbers, item and call ids (derived from the stream, not drawn
    at random), indexes, closing event and usage."""
    first, second = gateways
    said = f"<think>Paris? Yes.</think>\n\nLet me look.{CALL}"
    if kind == "responses":
        api = {"path": "/v1/responses", "body": {
            "model": MODEL, "input": f"SAY[{said}]SAY", "max_output_tokens": 200, "stream": True,
            "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]}}
    else:
        api = {"path": "/v1/messages", "body": {
            "model": MODEL, "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": f"SAY[{said}]SAY"}],
            "tools": [{"name": "get_weather", "input_schema": SCHEMA}]}}
    fake_worker.gate.set()
    done = RawStream(first.rest_url, api_key, api).read_all()
    done.close()
    assert done.response.status_code == 200
    types = [e["data"]["type"] for e in done.events]
    if kind == "responses":
        assert {"response.reasoning_text.delta", "response.function_call_arguments.done"} <= set(types)
        assert done.events[-1]["data"]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    else:
        assert '"thinking_delta"' in json.dumps(done.events) and '"input_json_delta"' in json.dumps(done.events)
    ids = list(dict.fromkeys(e["id"] for e in done.events))
    assert len(ids) > 3
    # the closing events (after the last delta's frames) each have an id of their own,
    # <offset>.1, <offset>.2, ...: a client that got some of them gets each of the others once
    closing = 1 + max(i for i, e in enumerate(done.events) if "." not in e["id"].rsplit("/", 1)[1])
    offset = _offset(done.events[-1]["id"])
    assert [e["id"] for e in done.events[closing:]] == [
        f"{done.request_id}/{offset}.{k}" for k in range(1, len(done.events) - closing + 1)]
    assert done.events[-1]["data"]["type"] == ("response.completed" if kind == "responses" else "message_stop")
    for last_id in ids:  # broken after each id: the client has every event up to its last with that id
        got = RawStream(second.rest_url, api_key, api, last_id).read_all()
        got.close()
        assert got.response.status_code == 200, last_id
        had = 1 + max(i for i, e in enumerate(done.events) if e["id"] == last_id)
        assert done.events[:had] + got.events == done.events, last_id
