"""A constraint llguidance cannot enforce is a 400 that names the request's field and says
what is unsupported in a user's words, llguidance's own detail last: a new user saw only
"NoExtensionBias" (a regex that matches no text), and messages full of llguidance's wrapping
of the spec (``start: /.../``, ``at 1(8)``). Through a gateway with SmolLM2's tokenizer, as
the check runs in production (gateway/admission/structured.py)."""

from __future__ import annotations

import httpx
import pytest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


@pytest.fixture(scope="module")
def smollm2_gateway(redis_server):
    from common.model_files import default_model_path
    from common.tokenizer import load_tokenizer
    from tests.gateway.harness import start_gateway

    try:
        tokenizer = load_tokenizer(default_model_path())
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")
    gw = start_gateway(redis_server.url, tokenizer=tokenizer)
    yield gw
    gw.stop()


def _schema(schema):
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _tool(parameters):
    return {"tools": [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
                      {"type": "function", "function": {"name": "bad", "parameters": parameters}}],
            "tool_choice": "required"}


@pytest.mark.parametrize("extra,param,words", [
    ({"structured_outputs": {"regex": "[^\\x00-\\x{10FFFF}]"}}, "structured_outputs.regex",
     "matches no text at all"),
    ({"guided_regex": "(?=(a+))a*b"}, "guided_regex", "look-ahead and look-behind"),
    ({"structured_outputs": {"regex": "(a+)+\\1$"}}, "structured_outputs.regex", "back-references"),
    ({"guided_regex": "a(b"}, "guided_regex", "not a valid regular expression"),
    (_schema({"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]},
              "then": {}}), "response_format.json_schema.schema",
     "these JSON Schema keywords are not supported: if, then"),
    (_schema({"type": "frobnicate"}), "response_format.json_schema.schema", "'frobnicate' is not a JSON Schema type"),
    (_schema({"type": "string", "minLength": 5, "maxLength": 2}), "response_format.json_schema.schema",
     "no JSON value satisfies it"),
    ({"structured_outputs": {"json": {"$ref": "http://example.com/s.json"}}}, "structured_outputs.json",
     "'$ref' to another document is not fetched"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar",
     "'undefined_rule' is used but never defined"),
    ({"guided_grammar": 'start: "a" (( '}, "guided_grammar", "not valid Lark (or GBNF) syntax"),
    (_tool({"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}}),
     "tools[1].function.parameters", "these JSON Schema keywords are not supported: uniqueItems"),
], ids=["empty-language", "lookahead", "backreference", "bad-regex", "if-then", "unknown-type", "unsatisfiable",
        "remote-ref", "undefined-rule", "lark-syntax", "tool-parameters"])
def test_an_unenforceable_constraint_names_its_field_and_what_is_unsupported(
        smollm2_gateway, api_key, fake_worker, extra, param, words):
    n = len(fake_worker.requests)
    r = httpx.post(smollm2_gateway.rest_url + "/v1/chat/completions", json={**CHAT, **extra},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_structured_output", error
    message = error["message"]
    assert message.startswith(f"'{param}': ") and words in message, message
    assert "(llguidance: " in message and message.index(words) < message.index("(llguidance: "), message
    assert "\n" not in message and "start: /" not in message and "<non-verbose/>" not in message, message
    assert len(fake_worker.requests) == n


def test_the_responses_api_names_text_format_schema(smollm2_gateway, api_key):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "not": {"required": ["n"]}}
    r = httpx.post(smollm2_gateway.rest_url + "/v1/responses", timeout=30, headers={"Authorization": f"Bearer {api_key}"},
                   json={"input": "hi", "max_output_tokens": 16,
                         "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "text.format.schema", error
    assert error["message"].startswith("'text.format.schema': the JSON schema cannot be enforced: these JSON "
                                       "Schema keywords are not supported: not (llguidance: "), error
