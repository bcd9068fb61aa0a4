"""Structured outputs that parse (issue 45 item 6): objects closed, ``strict`` as OpenAI's
(every property required, nothing beyond the schema), no key written twice, and a
``max_tokens`` too small for the shortest valid output refused with a 400 naming it."""

from __future__ import annotations

import json

import llguidance
import openai
import pytest

from common.structured_outputs import StructuredOutputs
from gateway.admission.closed_schema import close_schema
from gateway.admission.params import RequestParams
from gateway.admission.shortest_output import fewest_tokens, shortest_text
from gateway.admission.structured import structured_outputs_from_fields
from gateway.admission.validation import RequestLimits, validate_request
from gateway.errors import InvalidRequestError
from gateway.tools.request import tool_fields
from tests.gateway.fake_tokenizer import CharTokenizer

#: The issue's case: a list of objects whose schema says nothing of additionalProperties.
ITEM = {"type": "object", "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"},
                                         "note": {"type": "string"}}, "required": ["x"]}
LIST = {"type": "array", "items": ITEM}


def _strict_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "strict": strict, "schema": schema}}


def test_strict_closes_every_object_and_requires_every_property():
    closed = close_schema(LIST, strict=True, param="p")
    assert closed["items"]["additionalProperties"] is False
    assert closed["items"]["required"] == ["x", "ok", "note"]
    assert LIST["items"].get("additionalProperties") is None  # the client's schema untouched
    assert close_schema({"type": "object"}, True, "p") == {"type": "object", "additionalProperties": False}
    loose = close_schema(LIST, strict=False, param="p")  # vLLM/xgrammar default: closed, required kept
    assert loose["items"]["additionalProperties"] is False and loose["items"]["required"] == ["x"]
    assert "additionalProperties" not in close_schema({"type": "object"}, False, "p")
    kept = close_schema({**ITEM, "additionalProperties": True}, False, "p")
    assert kept["additionalProperties"] is True
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert close_schema(both, True, "p") == both  # closing the parts would forbid every object
    derived = {"$defs": {"Base": {"properties": {"a": {}}}, "Other": {"properties": {"b": {}}}},
               "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"c": {}}}]}
    closed_defs = close_schema(derived, False, "p")["$defs"]
    assert "additionalProperties" not in closed_defs["Base"]  # extended by the allOf
    assert closed_defs["Other"]["additionalProperties"] is False
    assert close_schema({"type": "array", "prefixItems": [{"type": "integer"}]}, False, "p")["items"] is False


@pytest.mark.parametrize("schema, where", [
    ({**ITEM, "additionalProperties": True}, "response_format.json_schema.schema"),
    ({"type": "object", "properties": {"a": {**ITEM, "additionalProperties": {"type": "string"}}}},
     "response_format.json_schema.schema.properties.a"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}},
     "response_format.json_schema.schema"),
])
def test_strict_refuses_a_schema_that_opens_itself(schema, where):
    with pytest.raises(InvalidRequestError) as info:
        structured_outputs_from_fields(_strict_format(schema))
    assert info.value.param == where and "strict" in info.value.message
    structured_outputs_from_fields(_strict_format(schema, strict=False))  # not strict: allowed
    with pytest.raises(InvalidRequestError) as info:
        structured_outputs_from_fields({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}})
    assert info.value.param == "response_format.json_schema.strict"


@pytest.fixture(scope="module")
def smollm():
    try:
        from common.model_files import resolve_model_path
        from common.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(resolve_model_path(None))
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")
    ll = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size,
                                eos_token=sorted(tokenizer.eos_token_ids))
    return tokenizer, ll


def _accepts(smollm, spec: StructuredOutputs, text: str) -> bool:
    tokenizer, ll = smollm
    matcher = llguidance.LLMatcher(ll, spec.grammar(), log_level=0)
    ids = tokenizer.encode(text)
    return matcher.validate_tokens(ids) == len(ids)


def test_the_grammar_allows_no_extra_and_no_repeated_key(smollm):
    strict, _ = structured_outputs_from_fields(_strict_format(LIST))
    assert _accepts(smollm, strict, '[{"x":1,"ok":true,"note":""}]')
    assert not _accepts(smollm, strict, '[{"x":1,"ok":true,"note":"","name":"Mali"')  # the issue's output
    assert not _accepts(smollm, strict, '[{"x":1,"x":2')
    assert not _accepts(smollm, strict, '[{"x":1}]')  # strict: every property required
    loose, _ = structured_outputs_from_fields(_strict_format(LIST, strict=False))
    assert _accepts(smollm, loose, '[{"x":1}]')
    assert not _accepts(smollm, loose, '[{"x":1,"name"')
    grammar = tool_fields([{"type": "function", "function": {"name": "f", "parameters": ITEM}}],
                          "required", None, None)["structured_outputs"]
    assert _accepts(smollm, grammar, '<tool_call>\n{"name":"f","arguments":{"x":1}}\n</tool_call>')
    assert not _accepts(smollm, grammar, '<tool_call>\n{"name":"f","arguments":{"x":1,"x"')


def test_shortest_output_and_its_fewest_tokens(smollm):
    tokenizer, _ = smollm
    strict, param = structured_outputs_from_fields(_strict_format(LIST | {"minItems": 1}))
    text = shortest_text(strict, param=param)
    assert text == '[{"x":0,"ok":true,"note":""}]'
    assert fewest_tokens(tokenizer, text) <= len(tokenizer.encode(text))
    tools = tool_fields([{"type": "function", "function": {"name": "get", "parameters": ITEM}},
                         {"type": "function", "function": {"name": "f"}}],
                        "required", None, None)
    call = shortest_text(tools["structured_outputs"], tools["tools"], "tool_choice")
    assert call == '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>'
    assert shortest_text(StructuredOutputs.from_regex("a+")) is None
    assert shortest_text(StructuredOutputs.json_schema({"type": "string", "pattern": "a+"})) is None
    assert shortest_text(StructuredOutputs.from_choice(["yes", "no"])) == "no"


def test_max_tokens_below_the_shortest_output_is_refused():
    tokenizer, limits = CharTokenizer(), RequestLimits(served_model="m")
    found = structured_outputs_from_fields(_strict_format({"type": "object", "properties": {"name": {"type": "string"}}}))
    params = dict(messages=[{"role": "user", "content": "hi"}], structured_outputs=found[0],
                  structured_outputs_param=found[1])
    with pytest.raises(InvalidRequestError) as info:
        validate_request(tokenizer, limits, RequestParams(max_tokens=10, **params))
    assert info.value.param == "max_tokens" and info.value.code == "max_tokens_too_small"
    assert '{"name":""}' in info.value.message and "11 tokens" in info.value.message
    assert validate_request(tokenizer, limits, RequestParams(max_tokens=11, **params)).max_tokens == 11


def test_refused_through_the_rest_front(gateway, api_key):
    client = openai.OpenAI(base_url=gateway.rest_url + "/v1", api_key=api_key, max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, response_format=_strict_format(LIST | {"minItems": 1}))
    assert info.value.body["param"] == "max_tokens" and info.value.body["code"] == "max_tokens_too_small"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
            tools=[{"type": "function", "function": {"name": "f", "strict": True,
                                                     "parameters": {**ITEM, "additionalProperties": True}}}])
    assert info.value.body["param"] == "tools[0].function.parameters"
    assert json.loads(json.dumps(info.value.body))["code"] == "invalid_structured_output"
