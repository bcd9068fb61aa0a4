"""A tool-call round trip end to end: the official ``openai`` client through nginx, the
gateway, Redis and the worker running the real SmolLM2, whose chat template has no tool
format (the gateway's Hermes-style one is used, docs/TOOLS.md). ``tool_choice`` naming a
function and ``required`` are enforced by the grammar, so the call parses and its
arguments validate against the function's ``parameters``; the tool's result then goes
back as a ``role: "tool"`` message and the model answers."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.conftest import wait_all_blocks_free

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PARAMS = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS,
                                           "description": "The current weather in a city"}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "maxLength": 24}},
                                               "required": ["zone"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_call_round_trip(stack, rest_url, api_key):
    client = openai.OpenAI(base_url=f"{rest_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    named = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)

    answer = client.chat.completions.create(
        model=MODEL, tools=TOOLS, temperature=0, max_tokens=32,
        messages=[*QUESTION, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}])
    reply = answer.choices[0]
    assert reply.finish_reason in ("stop", "length", "tool_calls")
    assert reply.message.content or reply.message.tool_calls

    # required, sampled and streamed: every call the deltas add up to validates
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                                tool_choice="required", temperature=1, seed=7,
                                                max_tokens=96, stream=True,
                                                parallel_tool_calls=False):
        for c in chunk.choices:
            assert not c.delta.content
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[calls[0]["name"]]
    jsonschema.validate(json.loads(calls[0]["arguments"]), schema)
    wait_all_blocks_free(stack)
