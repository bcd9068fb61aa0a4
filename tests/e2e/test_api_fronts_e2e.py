"""Issue 45 with the real SmolLM2 through nginx: ``/tokenize`` counts what chat uses, the
official ``anthropic`` client (whole, streamed, a tool round trip), and the issue's strict
schema, which used to run to ``length`` adding keys of the model's own, now finishes and parses."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
ITEM = {"type": "object", "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}}}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}


def test_tokenize_counts_the_prompt_chat_uses(stack, rest_url, api_key):
    messages = [{"role": "user", "content": "Hello there"}]
    headers = {"Authorization": f"Bearer {api_key}"}
    counted = httpx.post(f"{rest_url}/tokenize", json={"messages": messages}, headers=headers, timeout=30).json()
    chat = openai.OpenAI(base_url=f"{rest_url}/v1", api_key=api_key, max_retries=0, timeout=180)
    used = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert counted["count"] == used.usage.prompt_tokens == len(counted["tokens"])
    text = httpx.post(f"{rest_url}/detokenize", json={"tokens": counted["tokens"]}, headers=headers, timeout=30).json()
    assert "<|im_start|>user\nHello there<|im_end|>" in text["prompt"]


def test_the_issues_strict_schema_finishes_and_parses(stack, rest_url, api_key):
    client = openai.OpenAI(base_url=f"{rest_url}/v1", api_key=api_key, max_retries=0, timeout=180)
    strict = {"type": "json_schema", "json_schema": {"name": "t", "strict": True,
                                                      "schema": {"type": "array", "items": ITEM}}}
    done = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120, response_format=strict,
        messages=[{"role": "user", "content": "List three African countries as JSON objects with x and ok."}])
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert all(set(o) == {"x", "ok"} for o in json.loads(choice.message.content))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=3, response_format=strict | {
            "json_schema": {**strict["json_schema"], "schema": {"type": "array", "items": ITEM, "minItems": 1}}},
            messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "max_tokens_too_small"


def test_anthropic_client_streaming_and_a_tool_round_trip(stack, rest_url, api_key):
    client = anthropic.Anthropic(base_url=rest_url, api_key=api_key, max_retries=0, timeout=180)
    message = client.messages.create(model=MODEL, max_tokens=12, system="Answer briefly.",
                                     messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 12
    with client.messages.stream(model=MODEL, max_tokens=12,
                                messages=[{"role": "user", "content": "Say hello."}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed and final.content[0].text == streamed

    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER], messages=asked,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert called.stop_reason == "tool_use", called.content
    call = next(b for b in called.content if b.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input["city"], str)
    answer = client.messages.create(model=MODEL, max_tokens=24, tools=[WEATHER], messages=[
        *asked, {"role": "assistant", "content": [b.model_dump() for b in called.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "18 degrees and sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    counted = client.messages.count_tokens(model=MODEL, messages=asked, tools=[WEATHER], tool_choice={"type": "any"})
    assert counted.input_tokens == called.usage.input_tokens + called.usage.cache_read_input_tokens
