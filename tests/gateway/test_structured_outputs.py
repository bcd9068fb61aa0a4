"""Structured outputs at the gateway (issue 26): OpenAI's ``response_format``, vLLM's
``structured_outputs`` and ``guided_*`` reach the queue as one ``StructuredOutputs``; a
malformed, unsupported, too large or too deep constraint is a 400 / INVALID_ARGUMENT naming
the field, nothing is queued, and the next request is served."""

from __future__ import annotations

import json
import threading

import grpc
import httpx
import pytest

from common.structured_outputs import StructuredOutputs
from gateway.admission.structured import GrammarChecker, GrammarLimits, check_structured_outputs
from gateway.errors import InvalidRequestError
from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.gateway.conftest import wait_for

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
#: What the queue carries for SCHEMA: the object closed (gateway/admission/closed_schema.py).
CLOSED = {**SCHEMA, "additionalProperties": False}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}  # room for '{"a":0}' 


def _post(gateway, api_key, body, path="/v1/chat/completions"):
    return httpx.post(gateway.rest_url + path, content=json.dumps(body),  # ASCII: "\ud800" travels escaped
                      headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}, timeout=30)


@pytest.mark.parametrize("extra,expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputs.any_json_object()),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs.json_schema(CLOSED)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputs.json_schema(CLOSED)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutputs.json_schema(CLOSED)),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutputs.from_regex("[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs.from_choice(["yes", "no"])),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutputs.from_grammar('start: "a"+')),
    ({"guided_json": SCHEMA}, StructuredOutputs.json_schema(CLOSED)),
    ({"guided_choice": ["a", "b"], "guided_decoding_backend": "xgrammar"}, StructuredOutputs.from_choice(["a", "b"])),
    ({"guided_regex": "x+"}, StructuredOutputs.from_regex("x+")),
    ({"guided_grammar": 'root ::= "y"'}, StructuredOutputs.from_grammar('root ::= "y"')),
], ids=["json_object", "json_schema", "so-json", "so-json-text", "so-regex", "so-choice", "so-grammar",
        "guided_json", "guided_choice", "guided_regex", "guided_grammar"])
def test_constraints_reach_the_queue(gateway, api_key, fake_worker, extra, expected):
    n = len(fake_worker.requests)
    r = _post(gateway, api_key, {**CHAT, **extra})
    assert r.status_code == 200, r.text
    assert wait_for(lambda: len(fake_worker.requests) > n)
    assert StructuredOutputs.from_proto(fake_worker.requests[-1].sampling.structured_outputs) == expected


def test_completions_take_them_too_and_text_is_no_constraint(gateway, api_key, fake_worker):
    n = len(fake_worker.requests)
    r = _post(gateway, api_key, {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"choice": ["a"]}},
              "/v1/completions")
    assert r.status_code == 200, r.text
    assert wait_for(lambda: len(fake_worker.requests) > n)
    assert fake_worker.requests[-1].sampling.structured_outputs.choice.choices == ["a"]
    r = _post(gateway, api_key, {**CHAT, "response_format": {"type": "text"}})
    assert r.status_code == 200 and not fake_worker.requests[-1].sampling.HasField("structured_outputs")


DEEP = {"type": "integer"}
for _ in range(100):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "object", "dependentSchemas": {"a": {}}}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"guided_choice": ["a", "\ud800"]}, "guided_choice"),
    ({"guided_json": {"enum": ["\udfff"]}}, "guided_json"),
    # hostile: nesting deeper than the limit, an enum larger than the size limit, regexes the
    # lexer cannot run (look-around, back-references: PCRE's catastrophic-backtracking tools)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": DEEP}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"enum": [f"value_{i:06d}" for i in range(20_000)]}}, "guided_json"),
    ({"guided_regex": "(?=(a+))a*b\\1"}, "guided_regex"),
    ({"guided_regex": "(a+)+\\1$"}, "guided_regex"),
])
def test_bad_and_hostile_constraints_are_400_and_nothing_is_queued(gateway, api_key, fake_worker, extra, param):
    n = len(fake_worker.requests)
    r = _post(gateway, api_key, {**CHAT, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert len(fake_worker.requests) == n
    assert _post(gateway, api_key, {**CHAT, "structured_outputs": {"choice": ["ok"]}}).status_code == 200


def _generate(gateway, api_key, structured):
    with grpc.insecure_channel(gateway.grpc_target) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        sampling = common_pb2.SamplingParams(max_tokens=8, structured_outputs=structured)
        return list(stub.Generate(inference_pb2.GenerateRequest(prompt="hi", sampling=sampling),
                                  metadata=(("authorization", f"Bearer {api_key}"),), timeout=10))


def test_grpc_structured_outputs(gateway, api_key, fake_worker):
    n = len(fake_worker.requests)
    _generate(gateway, api_key, common_pb2.StructuredOutputs(json=json.dumps(SCHEMA)))
    assert wait_for(lambda: len(fake_worker.requests) > n)
    assert StructuredOutputs.from_proto(fake_worker.requests[-1].sampling.structured_outputs) == (
        StructuredOutputs.json_schema(CLOSED))
    for bad in (common_pb2.StructuredOutputs(json="[1"), common_pb2.StructuredOutputs(regex="(?<=a)b"),
                common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList())):
        with pytest.raises(grpc.RpcError) as info:
            _generate(gateway, api_key, bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs" in info.value.details()


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from common.model_files import default_model_path
    from common.tokenizer import load_tokenizer

    try:
        return load_tokenizer(default_model_path())
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")


def test_the_check_compiles_against_the_real_vocabulary(smollm2_tokenizer):
    limits = GrammarLimits()
    for spec in (StructuredOutputs.json_schema(SCHEMA), StructuredOutputs.from_regex(r"(a+)+$"),
                 StructuredOutputs.from_regex("(a|b)*a(a|b){30}"), StructuredOutputs.from_choice(["x"] * 3)):
        check_structured_outputs(spec, "p", smollm2_tokenizer, limits)  # linear-time lexer: served
    with pytest.raises(InvalidRequestError, match="too big"):  # llguidance's own lexer limit
        check_structured_outputs(StructuredOutputs.json_schema({"enum": [f"v{i}" for i in range(9000)]}), "p",
                                 smollm2_tokenizer, GrammarLimits(lexer_fuel=20_000))


def test_a_compile_slower_than_the_budget_is_refused(smollm2_tokenizer):
    checker = GrammarChecker(smollm2_tokenizer, GrammarLimits(compile_budget_s=0.05))
    gate = threading.Event()
    checker._compile = lambda spec: (gate.wait(10), "")[1]
    assert "did not compile within the 0.05 s budget" in checker.verdict(StructuredOutputs.from_regex("a"))
    gate.set()
