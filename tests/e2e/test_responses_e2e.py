"""The Responses API end to end: the official ``openai`` client's ``responses`` through
nginx, the gateway, Redis and the worker running the real SmolLM2: a forced function call
(grammar-enforced, so its arguments validate), its output sent back with
``previous_response_id`` and answered, and the same streamed as typed events."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
          "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
          "parameters": PARAMS}]


def test_function_call_round_trip_and_stream(stack, rest_url, api_key):
    client = openai.OpenAI(base_url=f"{rest_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    temperature=0, max_output_tokens=48)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), PARAMS)

    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, temperature=0, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    assert second.output_text or any(item.type == "function_call" for item in second.output)
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn is in the prompt

    events = list(client.responses.create(model=MODEL, input="Say hello.", temperature=0,
                                          max_output_tokens=8, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[0].type == "response.created" and deltas
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == "".join(deltas)
