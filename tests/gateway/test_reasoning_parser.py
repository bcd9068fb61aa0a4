"""``--reasoning-parser`` through the real gateway and the fake worker, whose ``SAY[...]SAY``
script streams a ``<think>`` model's output in 3-character pieces (so both tags are cut
across pieces): chat completions put the thinking in ``reasoning_content`` (whole and in
stream deltas), the Responses API in a ``reasoning`` item (and ``response.reasoning_text``
events), parsed by the ``openai`` package; tool calls after the thinking still parse. A
gateway without the parser returns the text as written."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway.fake_tokenizer import CharTokenizer
from tests.gateway.harness import start_gateway

THOUGHT = "<think>\nThe user greets me.\n</think>\n\nHello!"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _say(text: str) -> list[dict]:
    return [{"role": "user", "content": f"SAY[{text}]SAY"}]


@pytest.fixture(scope="module")
def thinking_gateway(redis_server):
    gw = start_gateway(redis_server.url, tokenizer=CharTokenizer(context_length=4096),
                       reasoning_parser="qwen3")
    yield gw
    gw.stop()


@pytest.fixture()
def client(thinking_gateway, api_key):
    return openai.OpenAI(base_url=thinking_gateway.rest_url + "/v1", api_key=api_key, max_retries=0,
                         timeout=10)


# The fake worker sends one token per 3-character piece: the 36 characters from "<think>" to
# "</think>" are 12 tokens spent thinking, "\n\nHello!" 3 more.
THOUGHT_TOKENS, ANSWER_TOKENS = 12, 3


def test_chat_reasoning_content(client):
    resp = client.chat.completions.create(model="test-model", messages=_say(THOUGHT), max_tokens=200)
    message = resp.choices[0].message
    assert message.content == "Hello!"
    assert message.model_extra["reasoning_content"] == "\nThe user greets me.\n"
    assert resp.usage.completion_tokens == THOUGHT_TOKENS + ANSWER_TOKENS
    assert resp.usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS


def test_reasoning_tokens_in_a_streams_usage_and_none_without_thinking(client):
    chunks = list(client.chat.completions.create(model="test-model", messages=_say(THOUGHT), max_tokens=200,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    resp = client.chat.completions.create(model="test-model", messages=_say("Just an answer."), max_tokens=200)
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_stream_reasoning_deltas(client):
    chunks = list(client.chat.completions.create(model="test-model", messages=_say(THOUGHT),
                                                 max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [d.model_extra.get("reasoning_content") for d in deltas]
    assert sum(1 for r in reasoning if r) > 1  # streamed in pieces, not at the end
    assert "".join(r or "" for r in reasoning) == "\nThe user greets me.\n"
    assert "".join(d.content or "" for d in deltas) == "Hello!"
    assert not any("<think>" in (d.content or "") or "think>" in (r or "") for d, r in zip(deltas, reasoning))


def test_chat_tool_call_after_thinking(client):
    text = "<think>Weather needs a call.</think>\n" + CALL
    for stream in (False, True):
        resp = client.chat.completions.create(model="test-model", messages=_say(text), tools=[WEATHER],
                                              max_tokens=300, stream=stream)
        if stream:
            chunks = [c for c in resp if c.choices]
            reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
            args = "".join(tc.function.arguments or "" for c in chunks for tc in c.choices[0].delta.tool_calls or ())
            finish = chunks[-1].choices[0].finish_reason
        else:
            message = resp.choices[0].message
            reasoning, args = message.model_extra["reasoning_content"], message.tool_calls[0].function.arguments
            finish = resp.choices[0].finish_reason
        assert reasoning == "Weather needs a call." and json.loads(args) == {"city": "Oslo"}
        assert finish == "tool_calls"


def test_responses_reasoning_item(client):
    resp = client.responses.create(model="test-model", input=f"SAY[{THOUGHT}]SAY")
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "\nThe user greets me.\n"
    assert resp.output_text == "Hello!"
    assert resp.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS


def test_responses_stream_reasoning_events(client):
    events = list(client.responses.create(model="test-model", input=f"SAY[{THOUGHT}]SAY", stream=True))
    thinking = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(thinking) > 1 and "".join(thinking) == "\nThe user greets me.\n"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello!"
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"]
    completed = [e for e in events if e.type == "response.completed"][0]
    assert completed.response.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS


def test_without_the_parser_the_text_is_as_written(gateway, api_key):
    r = httpx.post(gateway.rest_url + "/v1/chat/completions", timeout=10,
                   headers={"Authorization": f"Bearer {api_key}"},
                   json={"messages": _say("<think>x</think>y"), "max_tokens": 20})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "<think>x</think>y"}
    assert r.json()["usage"].get("completion_tokens_details") is None  # no parser: nothing is reasoning
