"""The queued ``StructuredOutputs`` becomes the engine's ``GrammarSpec`` (worker/serve/request_codec.py)."""

from __future__ import annotations

from common.structured_outputs import StructuredOutputs
from protos import common_pb2, queue_pb2
from worker.serve.request_codec import to_engine_request, to_grammar_spec


def test_each_kind_becomes_the_grammar_the_gateway_checked():
    for spec in (StructuredOutputs.json_schema({"type": "object"}), StructuredOutputs.any_json_object(),
                 StructuredOutputs.from_regex("[0-9]+"), StructuredOutputs.from_choice(["a", "b"]),
                 StructuredOutputs.from_grammar('start: "x"')):
        grammar = to_grammar_spec(spec.to_proto())
        assert (grammar.key, grammar.grammar, grammar.error) == (spec.key(), spec.grammar(), "")


def test_unset_is_free_text_and_a_bad_grammar_carries_its_error():
    queued = queue_pb2.QueuedRequest(request_id="r", prompt_token_ids=[1],
                                     sampling=common_pb2.SamplingParams(max_tokens=4))
    assert to_engine_request(queued).sampling_params.grammar is None
    bad = to_grammar_spec(common_pb2.StructuredOutputs(grammar="root ::= ("))
    assert bad.grammar == "" and bad.error.startswith("structured_outputs: ")
