"""Anthropic's Messages API (issue 45 item 2) through the official ``anthropic`` client against
the real gateway and Redis and the fake worker (its ``SAY[text]SAY`` script writes the output):
text and tool calls, whole and streamed, a tool round trip, count_tokens and error shapes."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from gateway.rest.anthropic_format import MessageEvents, matched_stop
from protos import common_pb2
from tests.gateway.fake_tokenizer import CharTokenizer
from tests.gateway.harness import start_gateway

MODEL = "test-model"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def messages_gateway(redis_server):
    """A gateway whose context holds the tool prompt (4,096 one-character tokens), with Qwen3's
    reasoning parser (an output that does not open with <think> is all answer)."""
    gw = start_gateway(redis_server.url, tokenizer=CharTokenizer(context_length=4096),
                       reasoning_parser="qwen3")
    yield gw
    gw.stop()


@pytest.fixture()
def client(messages_gateway, api_key):
    return anthropic.Anthropic(base_url=messages_gateway.rest_url, api_key=api_key, max_retries=0, timeout=10)


def test_text_whole_and_streamed(client):
    message = client.messages.create(model=MODEL, max_tokens=3, system="be brief",
                                     messages=[{"role": "user", "content": "hi"}])
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "w0 w1 w2 "
    assert message.stop_reason == "max_tokens" and message.role == "assistant"
    assert message.usage.output_tokens == 3 and message.usage.input_tokens > 0
    assert message.id.startswith("msg_")
    with client.messages.stream(model=MODEL, max_tokens=50,
                                messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == "w0 w1 w2 w3 w4 " and final.stop_reason == "end_turn"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.usage.output_tokens == 5


def test_tool_round_trip_whole_and_streamed(client, fake_worker):
    asked = [{"role": "user", "content": f"SAY[Let me look.\n{CALL}]SAY"}]
    message = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=asked)
    assert message.stop_reason == "tool_use"
    text, call = message.content
    assert text.type == "text" and text.text == "Let me look."
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id.startswith("toolu_")

    with client.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER], messages=asked,
                                tool_choice={"type": "auto"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == ["text", "tool_use"]
    assert streamed.content[1].input == {"city": "Paris"}

    # the result goes back: the history renders as the chat route's (tool message, call block)
    n = len(fake_worker.requests)
    answer = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=[
        *asked, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "SAY[18 C, sunny]SAY"}]}]}])
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "18 C, sunny"
    prompt = "".join(chr(t) for t in fake_worker.requests[n].prompt_token_ids)
    assert "<tool_response>\nSAY[18 C, sunny]SAY\n</tool_response>" in prompt
    assert '"arguments": {"city": "Paris"}' in prompt


def test_forced_tool_streams_input_json(client, fake_worker):
    args = '{"city":"Oslo"}'
    said = f'<tool_call>\n{{"name":"get_weather","arguments":{args}}}\n</tool_call>'
    n = len(fake_worker.requests)
    with client.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": f"SAY[{said}]SAY"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert fake_worker.requests[n].sampling.structured_outputs.grammar  # the call is enforced
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Oslo"} and final.content[0].input == {"city": "Oslo"}


def test_count_tokens_is_the_prompt_the_request_uses(client, fake_worker):
    messages = [{"role": "user", "content": "SAY[ok]SAY"}]
    counted = client.messages.count_tokens(model=MODEL, system="sys", messages=messages, tools=[WEATHER])
    used = client.messages.create(model=MODEL, max_tokens=5, system="sys", messages=messages, tools=[WEATHER])
    assert counted.input_tokens == used.usage.input_tokens + used.usage.cache_read_input_tokens > 20


def test_errors_have_anthropics_shape(messages_gateway, client, api_key):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                          "message": info.value.body["error"]["message"]}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "", "media_type": "image/png"}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:  # prefill: refused, not rendered as a closed turn
        client.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}])
    assert "messages[1].role" in info.value.body["error"]["message"]
    bad = anthropic.Anthropic(base_url=messages_gateway.rest_url, api_key="sk-inflight-nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(messages_gateway.rest_url + "/v1/messages", json={"model": MODEL, "messages": []},
                   headers={"authorization": f"Bearer {api_key}"}, timeout=10)  # the Bearer header works too
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(messages_gateway.rest_url + "/v1/chat/completions", json={}, timeout=10)  # no key: 401 first
    assert "type" not in r.json() and r.json()["error"]["code"] == "missing_api_key"  # OpenAI's shape there


def test_a_failure_mid_stream_is_an_error_event(client):
    with pytest.raises(anthropic.APIStatusError) as info:
        with client.messages.stream(model=MODEL, max_tokens=50,
                                    messages=[{"role": "user", "content": "fail"}]) as stream:
            list(stream)
    assert info.value.body["error"]["type"] == "api_error"


def test_stop_sequence_is_told_from_the_tokens():
    tokenizer = CharTokenizer()
    ids = [ord(c) for c in "hello END more"]
    assert matched_stop(tokenizer, ids[:9], "hello ", ("END",)) == "END"
    assert matched_stop(tokenizer, ids[:6], "hello ", ("END",)) is None  # ended at EOS
    assert matched_stop(tokenizer, ids, "hello END more", ()) is None


def test_event_order_of_text_then_call():
    from gateway.tools.spec import check_tools
    tools = check_tools([{"type": "function", "function": {"name": "f"}}], None)
    events = MessageEvents("r", MODEL, tools)
    frames = events.text("Hi.\n<tool_call>\n") + events.text('{"name": "f", "arguments": {}}\n</tool_call>')
    frames += events.finish("tool_use", None, 7)
    kinds = [f.split(b"\n", 1)[0].decode() for f in frames]
    assert kinds == ["event: content_block_start", "event: content_block_delta", "event: content_block_stop",
                     "event: content_block_start", "event: content_block_delta", "event: content_block_stop",
                     "event: message_delta", "event: message_stop"]
    assert common_pb2.FINISH_REASON_STOP  # the proto the stop reasons come from


def test_documented_with_anthropics_error_body(messages_gateway):
    doc = httpx.get(messages_gateway.rest_url + "/openapi.json", timeout=10).json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = doc["paths"][path]["post"]["responses"]
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicErrorResponse")
    assert "max_tokens" in doc["components"]["schemas"]["MessagesRequest"]["required"]


def test_thinking_blocks_whole_and_streamed(client):
    said = [{"role": "user", "content": f"SAY[<think>Paris? Yes.</think>\n\nIt is Paris.\n{CALL}]SAY"}]
    message = client.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER], messages=said)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "Paris? Yes." and message.content[1].text == "It is Paris."
    with client.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER], messages=said) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.content[0].thinking == "Paris? Yes." and final.content[2].input == {"city": "Paris"}
    assert deltas[0] == "thinking_delta" and "text_delta" in deltas and "input_json_delta" in deltas
