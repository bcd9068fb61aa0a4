"""A resumed ``/v1/chat/completions`` stream continues the same parse (``tools``, the
reasoning parser): a resuming gateway rebuilds the chunk state the client has (the tool
parser's, the call ids made stable from the stream's internal id, the reasoning splitter's,
the reasoning token count) from the journaled deltas, then sends only what follows. Real
gateways, real Redis, the scripted worker (its gate holds a stream after 12 pieces of 3
characters)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway.fake_tokenizer import CharTokenizer
from tests.gateway.fake_worker import GATED
from tests.gateway.harness import start_gateway
from tests.gateway.test_agent_stream_resume import _forget_journals
from tests.gateway.test_stream_relay import _internal_id, _runs_of

MODEL = "test-model"
WAIT_S = 20.0
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris@i", "days": 3}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


def _body(said: str, gated: bool = False, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"{GATED if gated else ''}SAY[{said}]SAY"}],
            "max_tokens": 200, "stream": True, "tools": TOOLS,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **extra}


@pytest.fixture()
def gateways(redis_url, fake_worker):
    """Two gateways with Qwen3's reasoning parser; the first's lease is long (600 s: only its
    death ends it), the second's short (a takeover is quick)."""
    tokenizer = CharTokenizer(context_length=4096)  # room for a tool prompt
    started = [start_gateway(redis_url, tokenizer=tokenizer, stream_owner_lease_s=600.0, reasoning_parser="qwen3"),
               start_gateway(redis_url, tokenizer=tokenizer, stream_owner_lease_s=1.0, reasoning_parser="qwen3")]
    yield started
    fake_worker.gate.clear()
    for gw in started:
        if gw.thread.is_alive():
            gw.stop()


class Chunks:
    """A chat SSE response read incrementally: ``events`` (``id`` and the parsed ``data``,
    ``[DONE]`` kept as the string) and the offset of its last ``id:``."""

    def __init__(self, url: str, key: str, body: dict, last_event_id: str | None = None):
        headers = {"Authorization": f"Bearer {key}"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self._cm = httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                                timeout=httpx.Timeout(WAIT_S, read=WAIT_S * 3))
        self.response = self._cm.__enter__()
        self._lines = self.response.iter_lines() if self.response.status_code == 200 else iter(())
        self.events: list[dict] = []
        self.tokens = 0

    def read_until(self, predicate) -> "Chunks":
        block: dict = {}
        while not predicate(self):
            line = next(self._lines, None)
            if line is None:
                return self
            if line:
                name, _, value = line.partition(": ")
                block[name] = value if name != "data" or value == "[DONE]" else json.loads(value)
                continue
            if block:
                self.events.append(block)
                if "id" in block:
                    self.tokens = int(block["id"].rsplit("/", 1)[1].split(".")[0])  # a closing chunk: .k
                block = {}
        return self

    def read_all(self) -> "Chunks":
        return self.read_until(lambda s: bool(s.events) and s.events[-1].get("data") == "[DONE]")

    @property
    def request_id(self) -> str:
        return self.response.headers["x-request-id"]

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def _read(url: str, key: str, body: dict, last_event_id: str | None = None) -> Chunks:
    got = Chunks(url, key, body, last_event_id).read_all()
    got.close()
    assert got.response.status_code == 200, (last_event_id, got.response.read())
    return got


def _closing(stream: Chunks) -> int:
    """The index of the first finish chunk (every choice's, ``n`` > 1 too, follow the last
    delta: closing chunks, each with its own ``<request id>/<offset>.<k>``)."""
    return min(i for i, e in enumerate(stream.events)
               if isinstance(e["data"], dict) and any(c["finish_reason"] for c in e["data"]["choices"]))


def _calls(chunks: list[dict], index: int = 0) -> list[dict]:
    """Choice ``index``'s calls as a client joins its ``tool_calls`` deltas."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls") or () if choice["index"] == index else ():
                call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.get("id") or call["id"]
                call["name"] = delta.get("function", {}).get("name") or call["name"]
                call["arguments"] += delta["function"].get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def _joined(chunks: list[dict], field: str, index: int = 0) -> str:
    return "".join(c["delta"].get(field) or "" for chunk in chunks for c in chunk["choices"] if c["index"] == index)


def _normal(chunks: list[dict]) -> list[dict]:
    """``chunks`` without what differs between two runs of one body (the chunk id, ``created``,
    the call ids: each run has its own)."""
    out = []
    for chunk in chunks:
        chunk = json.loads(json.dumps({k: v for k, v in chunk.items() if k not in ("id", "created")}))
        for choice in chunk["choices"]:
            for call in choice["delta"].get("tool_calls") or ():
                if "id" in call:
                    call["id"] = "<id>"
        out.append(chunk)
    return out


def _data(events: list[dict]) -> list[dict]:
    return [e["data"] for e in events if isinstance(e.get("data"), dict)]


BROKEN = {  # where the client's last chunk leaves a parser mid-way, and its offset
    # "y<t": the content "y" is sent, "<t" held; the rest of the tag follows the resume
    "in a tool call": ("Okay" + CALL, 2),
    "in the thinking": ("<think>Paris, I think: the weather tool, then answer.</think>\n\n" + CALL, 5),
}


@pytest.mark.parametrize("where", list(BROKEN))
def test_a_stream_broken_mid_parse_resumes_on_another_gateway(gateways, api_key, fake_worker, redis_url, where):
    """The first gateway dies with the client's parse mid-way (a tag half read, the thinking
    open); the other gateway takes the stream over and its rest, joined to what the client
    had, is the unbroken run's chunks: the same reasoning/content split, the same
    ``tool_calls`` deltas, finish reason and usage."""
    first, second = gateways
    said, offset = BROKEN[where]
    body = _body(said, gated=True)
    fake_worker.gate.set()
    whole = _read(first.rest_url, api_key, body)
    fake_worker.gate.clear()
    _forget_journals(redis_url)
    original = Chunks(first.rest_url, api_key, body).read_until(lambda s: s.tokens >= offset)
    assert original.response.status_code == 200 and original.tokens == offset
    internal = _internal_id(redis_url)
    first.stop()
    fake_worker.gate.set()
    try:
        rest = _read(second.rest_url, api_key, body, f"{original.request_id}/{offset}")
    finally:
        original.close()
    joined, unbroken = _data(original.events) + _data(rest.events), _data(whole.events)
    assert _normal(joined) == _normal(unbroken)
    assert _calls(joined)[0]["name"] == "get_weather"
    assert json.loads(_calls(joined)[0]["arguments"]) == {"city": "Paris0", "days": 3}
    assert joined[-2]["choices"][0]["finish_reason"] == "tool_calls"
    if where == "in the thinking":
        assert _joined(joined, "reasoning_content").startswith("Paris, I think")
        assert joined[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    assert joined[-1]["usage"] == unbroken[-1]["usage"]
    assert len(_runs_of(fake_worker, internal)) == 2  # the run, then one continuation


def test_a_resume_mid_parse_while_the_owner_streams_is_relayed(gateways, api_key, fake_worker, redis_url):
    """The first connection stays open, unread, its client's parse inside a tag: the resume
    relays the owner's journal with the parse rebuilt; the worker ran the request once."""
    first, second = gateways
    said, offset = BROKEN["in a tool call"]
    body = _body(said, gated=True)
    fake_worker.gate.set()
    whole = _read(first.rest_url, api_key, body)
    fake_worker.gate.clear()
    _forget_journals(redis_url)
    original = Chunks(first.rest_url, api_key, body).read_until(lambda s: s.tokens >= offset)
    internal = _internal_id(redis_url)
    resumed = Chunks(second.rest_url, api_key, body, f"{original.request_id}/{offset}")
    try:
        assert resumed.response.status_code == 200
        fake_worker.gate.set()
        resumed.read_all()
    finally:
        resumed.close()
        original.close()
    joined = _data(original.events) + _data(resumed.events)
    assert _normal(joined) == _normal(_data(whole.events))
    assert json.loads(_calls(joined)[0]["arguments"]) == {"city": "Paris0", "days": 3}
    assert len(_runs_of(fake_worker, internal)) == 1


CASES = {
    "reasoning then a call": ({}, 1),
    "a required call, its arguments streamed": ({"tool_choice": "required"}, 1),
    "two choices": ({"n": 2}, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_finished_stream_with_reasoning_and_a_call_resumes_at_each_of_its_ids(gateways, api_key, fake_worker,
                                                                                   case):
    """Thinking, text, then a call: resumed (replayed: it finished) on the other gateway at
    each of its ids, the chunks the client had and the rest are exactly the stream's, JSON
    for JSON: the same reasoning and content, the same call ids (derived from the stream,
    not drawn at random), indexes and argument fragments, finish reasons and usage."""
    first, second = gateways
    extra, n = CASES[case]
    said = "<think>Paris? Yes.</think>\n\nLet me look." + CALL
    body = _body(said, **extra)
    fake_worker.gate.set()
    done = _read(first.rest_url, api_key, body)
    chunks = _data(done.events)
    for i in range(n):
        assert _joined(chunks, "reasoning_content", i) == "Paris? Yes."
        assert _calls(chunks, i)[0]["id"].startswith("call_")
        assert json.loads(_calls(chunks, i)[0]["arguments"]) == {"city": f"Paris{i}", "days": 3}
    assert sum(1 for c in chunks for ch in c["choices"] if ch["finish_reason"] == "tool_calls") == n
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    ids = list(dict.fromkeys(e["id"] for e in done.events if "id" in e))
    assert len(ids) > 10
    # every chunk after the last delta's (each choice's finish, n > 1 too, and the usage) has
    # an id of its own, <offset>.<k>: a client that got some of them gets each of the others once
    closing, offset = min(i for i, e in enumerate(done.events) if "." in e.get("id", ".")), done.tokens
    assert closing <= _closing(done) and done.events[closing - 1]["id"].rsplit("/", 1)[1].isdigit()
    assert [e.get("id") for e in done.events[closing:]] == [
        *(f"{done.request_id}/{offset}.{k}" for k in range(1, len(done.events) - closing)), None]
    for last_id in ids:  # broken after each id: the client has every chunk up to its last with that id
        got = _read(second.rest_url, api_key, body, last_id)
        had = 1 + max(i for i, e in enumerate(done.events) if e.get("id") == last_id)
        assert done.events[:had] + got.events == done.events, last_id


def test_a_grpc_stream_with_a_call_resumes_at_each_of_its_offsets(gateways, api_key, fake_worker):
    """gRPC's ``Resume`` of a finished ``Generate`` with tools: the messages the client had and
    the rest are the stream's, the call's id and arguments fragments included."""
    import grpc

    from protos import common_pb2, inference_pb2, inference_pb2_grpc

    first, second = gateways
    request = inference_pb2.GenerateRequest(
        model=MODEL, chat=inference_pb2.ChatMessages(messages=[
            inference_pb2.ChatMessage(role="user", content=f"SAY[Okay{CALL}]SAY")]),
        sampling=common_pb2.SamplingParams(max_tokens=200),
        tools=[inference_pb2.Tool(function=inference_pb2.FunctionDefinition(
            name="get_weather", parameters=json.dumps(SCHEMA)))])
    metadata = (("authorization", f"Bearer {api_key}"),)
    fake_worker.gate.set()
    with grpc.insecure_channel(first.grpc_target) as channel:
        whole = list(inference_pb2_grpc.InferenceStub(channel).Generate(request, metadata=metadata, timeout=10))
    calls = [c for r in whole for c in r.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Paris0", "days": 3}
    assert whole[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    with grpc.insecure_channel(second.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        offset = 0
        for had, response in enumerate(whole):
            if response.finish_reason:
                break
            offset += len(response.token_ids)
            resume = inference_pb2.ResumeRequest(request_id=whole[0].request_id, offset=offset, request=request)
            rest = list(stub.Resume(resume, metadata=metadata, timeout=10))
            assert whole[:had + 1] + rest == whole, offset
