"""Structured outputs end to end (issue 26): the official ``openai`` client's
``chat.completions.parse`` with a pydantic model, through nginx, the gateway, Redis and the
worker running the real SmolLM2; a hostile schema is refused at the gateway and the engine
serves the next request."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.conftest import wait_all_blocks_free

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str
    country: str
    population: int
    is_capital: bool


class ShortCity(BaseModel):
    """Bounded, so that even a sample at temperature 1 closes within max_tokens."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=10**9)


def test_openai_parse_with_a_pydantic_model_and_the_other_kinds(stack, rest_url, api_key):
    client = openai.OpenAI(base_url=f"{rest_url}/v1", api_key=api_key, max_retries=0, timeout=180)
    completion = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=96, response_format=City,
        messages=[{"role": "user", "content": "Describe Paris as JSON with name, country, population, is_capital."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City), choice.message.content
    assert City.model_validate_json(choice.message.content) == choice.message.parsed

    sampled = client.chat.completions.create(  # temperature 1, n = 2, streamed: each choice parses
        model=MODEL, temperature=1, seed=7, n=2, max_tokens=96, stream=True,
        messages=[{"role": "user", "content": "A city as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "strict": True,
                                                                "schema": ShortCity.model_json_schema()}})
    texts: dict[int, str] = {}
    for chunk in sampled:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert len(texts) == 2
    for text in texts.values():
        ShortCity.model_validate_json(text)

    picked = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, messages=[{"role": "user", "content": "Is water wet?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert picked.choices[0].message.content in ("yes", "no")

    anything = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=96, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}])
    if anything.choices[0].finish_reason == "stop":  # any object: its strings are unbounded
        assert isinstance(json.loads(anything.choices[0].message.content), dict)

    deep: dict = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}})
    assert info.value.body["param"] == "response_format.json_schema.schema" and "deeper" in info.value.body["message"]
    again = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=96, response_format=City,
        messages=[{"role": "user", "content": "Describe Paris as JSON with name, country, population, is_capital."}])
    assert again.choices[0].message.parsed == choice.message.parsed  # the engine is unaffected
    wait_all_blocks_free(stack)


def test_min_tokens_under_a_constraint(stack, rest_url, api_key):
    """min_tokens under a grammar, with the real SmolLM2 (vLLM's semantics): EOS stays masked
    while the grammar allows more (a number goes on to at least min_tokens tokens), a complete
    output (a boolean) ends with stop before it, and a choice that can never reach it is a 400
    naming both fields."""
    client = openai.OpenAI(base_url=f"{rest_url}/v1", api_key=api_key, max_retries=0, timeout=180)
    ask = [{"role": "user", "content": "How many legs does a spider have?"}]
    number = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, messages=ask,
                                            extra_body={"structured_outputs": {"regex": "[0-9]+"}, "min_tokens": 10})
    assert number.choices[0].message.content.isdigit() and number.usage.completion_tokens >= 10, number
    yes_no = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, messages=ask,
                                            extra_body={"guided_json": {"type": "boolean"}, "min_tokens": 10})
    assert yes_no.choices[0].finish_reason == "stop" and yes_no.choices[0].message.content in ("true", "false")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=16, messages=ask,
                                       extra_body={"structured_outputs": {"choice": ["six", "eight"]}, "min_tokens": 9})
    assert info.value.body["param"] == "min_tokens" and "'structured_outputs.choice'" in info.value.body["message"]
    wait_all_blocks_free(stack)
