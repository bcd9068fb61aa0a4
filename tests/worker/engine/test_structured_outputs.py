"""Grammar-constrained decoding in the engine (issue 26): a tiny random-weight Llama over
SmolLM2's real tokenizer, so every step is milliseconds and the grammar alone decides
whether the output is valid (a random model is the harshest writer of JSON there is).

The corpus (60 schemas, ``schema_corpus.py``) runs at temperature 0 and 1 in one batch
with unconstrained greedy neighbours; every output must parse and validate with
``jsonschema`` and finish with "stop", and the neighbours must write what they write alone.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from common.structured_outputs import StructuredOutputs
from bench.schema_corpus import corpus
from tests.worker.engine_helpers import assert_no_leaks, drain
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.engine_config import EngineConfig, SpeculativeConfig
from worker.engine.sampling_params import GrammarSpec, SamplingParams

NEIGHBOURS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def main():"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from common.model_files import default_model_path
    from common.tokenizer import load_tokenizer

    try:
        return load_tokenizer(default_model_path())
    except (FileNotFoundError, ModuleNotFoundError) as exc:  # model package not installed
        pytest.skip(f"default model files unavailable: {exc}")


def _engine(tokenizer, num_blocks: int = 1024, **config) -> LLMEngine:
    from worker.model.model_runner import tiny_random_runner

    runner = tiny_random_runner(vocab_size=tokenizer.vocab_size, block_size=16, num_blocks=num_blocks)
    return LLMEngine(runner, tokenizer, EngineConfig(block_size=16, **config))


@pytest.fixture(scope="module")
def engine(tokenizer):
    """One engine for the tests that need no special configuration (each leaves it empty)."""
    return _engine(tokenizer)


def _grammar(spec: StructuredOutputs) -> GrammarSpec:
    return GrammarSpec(spec.key(), spec.grammar())


def _params(spec: StructuredOutputs | None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 300)
    return SamplingParams(grammar=None if spec is None else _grammar(spec), **kw)


def _add(engine, rid, tokenizer, prompt, params, **kw):
    assert engine.add_request(EngineRequest(rid, tokenizer.encode(prompt), params, **kw)).ok


def _no_leaks(engine):
    assert_no_leaks(engine)
    assert engine.grammars.num_waiting == 0 and not engine.grammars._matchers


def _free_greedy(engine, tokenizer):
    for k, prompt in enumerate(NEIGHBOURS):
        _add(engine, f"free{k}", tokenizer, prompt, _params(None, temperature=0.0, max_tokens=24, ignore_eos=True))


def test_corpus_outputs_validate_at_t0_and_t1_and_neighbours_keep_their_text(engine, tokenizer):
    _free_greedy(engine, tokenizer)
    alone = {rid: r.text for rid, r in drain(engine).items()}
    schemas = corpus()
    assert len(schemas) >= 50
    for temperature in (0.0, 1.0):
        for k, schema in enumerate(schemas):
            _add(engine, f"s{k}", tokenizer, "JSON:",
                 _params(StructuredOutputs.json_schema(schema), temperature=temperature, seed=k))
        _free_greedy(engine, tokenizer)
        results = drain(engine)
        for k, schema in enumerate(schemas):
            r = results[f"s{k}"]
            assert r.finish_reason == "stop", (temperature, k, r.text)
            jsonschema.validate(json.loads(r.text), schema)
        assert {rid: results[rid].text for rid in alone} == alone
    _no_leaks(engine)


KINDS = [
    (StructuredOutputs.from_choice(["Paris", "London", "Rome"]), lambda t: t in ("Paris", "London", "Rome")),
    (StructuredOutputs.from_regex(r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    (StructuredOutputs.from_grammar('start: "(" num ("+" num)* ")"\nnum: /[1-9]/'),
     lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    (StructuredOutputs.from_grammar('root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),  # GBNF
    (StructuredOutputs.any_json_object(), lambda t: isinstance(json.loads(t), dict)),
]


def test_each_kind_constrains_the_output(engine, tokenizer):
    # Any JSON object's keys and strings are unbounded: a bias towards '"' and '}' (it
    # composes with the mask) lets a random model close them.
    bias = {tokenizer.encode(c)[0]: 10.0 for c in '"}'}
    for kind, (spec, _) in enumerate(KINDS):
        for k in range(3):
            _add(engine, f"{kind}-{k}", tokenizer, "Answer:", _params(
                spec, temperature=1.0, seed=k, max_tokens=400, logit_bias=bias if spec.kind == "json_object" else {}))
    for rid, r in drain(engine).items():
        check = KINDS[int(rid.split("-")[0])][1]
        assert r.finish_reason == "stop" and check(r.text), (rid, r.text)
    _no_leaks(engine)


def test_n_choices_each_follow_the_grammar_with_logprobs_and_stop_strings(engine, tokenizer):
    spec = StructuredOutputs.json_schema(PERSON)
    _add(engine, "n", tokenizer, "Person:", _params(spec, temperature=1.0, seed=3, logprobs=3), n=3)
    _add(engine, "stop", tokenizer, "Person:", _params(spec, temperature=0.0, stop=('"age"',)))
    texts, outputs = {}, []
    while engine.has_unfinished():
        outputs += engine.step()
    for out in outputs:
        texts[(out.request_id, out.index)] = texts.get((out.request_id, out.index), "") + out.text_delta
        for lp in out.logprobs or []:  # masked before the logprobs: forbidden tokens are no alternatives
            assert lp.logprob > float("-inf") and all(v > float("-inf") for _, v in lp.top)
    for index in range(3):
        jsonschema.validate(json.loads(texts[("n", index)]), PERSON)
    assert texts[("stop", 0)] == '{"name":' or texts[("stop", 0)].startswith('{"name":"')
    assert '"age"' not in texts[("stop", 0)]
    _no_leaks(engine)


def test_preemption_by_recompute_keeps_each_matcher(tokenizer):
    engine = _engine(tokenizer, num_blocks=5)  # 80 slots for 3 sequences of up to ~50 tokens
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 15, "maxItems": 15}
    for k in range(3):
        _add(engine, f"p{k}", tokenizer, "Numbers:", _params(StructuredOutputs.json_schema(schema),
                                                             temperature=1.0, seed=k, max_tokens=70))
    results = drain(engine)
    assert engine.stats().num_preemptions > 0
    for r in results.values():
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), schema)
    _no_leaks(engine)


def test_a_continuation_replays_its_resumed_tokens_into_the_matcher(engine, tokenizer):
    spec = StructuredOutputs.json_schema(PERSON)
    _add(engine, "whole", tokenizer, "Person:", _params(spec, temperature=0.0))
    whole = drain(engine)["whole"]
    cut = len(whole.token_ids) // 2
    resumed = whole.token_ids[:cut]
    _add(engine, "rest", tokenizer, "Person:", _params(spec, temperature=0.0),
         resumed_token_ids=resumed, resumed_text=tokenizer.decode(resumed))
    rest = drain(engine)["rest"]
    assert resumed + rest.token_ids == whole.token_ids and rest.finish_reason == "stop"
    _no_leaks(engine)


def test_speculative_decoding_drafts_only_for_unconstrained_rows(tokenizer, monkeypatch):
    """The simplest correct composition: constrained rows never get n-gram drafts (so a
    draft is never verified against a grammar it breaks); the others still do."""
    import worker.engine.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "propose_ngram", lambda tokens, room, lo, hi: tokens[-room:])
    spec_config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                                    disable_by_batch_size=16)
    engine = _engine(tokenizer, speculative=spec_config)
    for k in range(3):
        _add(engine, f"c{k}", tokenizer, "Person:", _params(StructuredOutputs.json_schema(PERSON),
                                                            temperature=0.0, seed=k))
    results = drain(engine)
    assert engine.stats().spec_num_draft_tokens == 0
    for r in results.values():
        jsonschema.validate(json.loads(r.text), PERSON)
    _add(engine, "free", tokenizer, "Hello", _params(None, temperature=0.0, max_tokens=12, ignore_eos=True))
    drain(engine)
    assert engine.stats().spec_num_draft_tokens > 0  # drafts still run for the others
    _no_leaks(engine)


def test_a_compiling_grammar_waits_off_the_engine_thread_while_others_step(tokenizer):
    engine = _engine(tokenizer)  # its own: the compiler is patched
    gate = threading.Event()
    build = engine.grammars.compiler._build
    engine.grammars.compiler._build = lambda grammar: (gate.wait(30), build(grammar))[1]
    _add(engine, "slow", tokenizer, "Person:", _params(StructuredOutputs.json_schema(PERSON), temperature=0.0))
    _add(engine, "free", tokenizer, "Hello", _params(None, temperature=0.0, max_tokens=8, ignore_eos=True))
    results: dict = {}
    for _ in range(8):
        for out in engine.step():
            results.setdefault(out.request_id, []).append(out)
    assert results["free"][-1].finished and "slow" not in results
    assert not any(s.request_id == "slow" for s in engine.scheduler.waiting + engine.scheduler.running)
    gate.set()
    r = drain(engine)["slow"]
    jsonschema.validate(json.loads(r.text), PERSON)
    _no_leaks(engine)


def test_a_bad_grammar_fails_its_request_only(engine, tokenizer):
    bad = EngineRequest("bad", tokenizer.encode("x"), SamplingParams(grammar=GrammarSpec("k", "", "no grammar")))
    assert engine.add_request(bad).status.value == "invalid"
    broken = GrammarSpec("broken", 'start: "a" undefined_rule')
    assert engine.add_request(EngineRequest("broken", tokenizer.encode("x"), SamplingParams(grammar=broken))).ok
    _add(engine, "free", tokenizer, "Hello", _params(None, temperature=0.0, max_tokens=8, ignore_eos=True))
    results = drain(engine)
    assert results["broken"].finish_reason == "error" and results["broken"].token_ids == []
    assert results["free"].finish_reason == "length" and len(results["free"].token_ids) == 8
    _no_leaks(engine)


def test_a_grammar_that_fails_while_generating_ends_its_request_with_a_client_error(engine, tokenizer):
    """A regex llguidance compiles but whose lexer runs out of its budget computing a mask
    (``a{1000}{1000}``): the request ends with "error", a one-line reason naming the grammar
    and the code ``invalid_request`` (a 400 or a stream's error event at the gateway), never
    a silent "stop" nor an anonymous internal error; a neighbour is untouched. Twice: the
    second matcher of the cached grammar fails before any token (a new user saw it answered
    as a successful empty stream)."""
    spec = StructuredOutputs.from_regex("a{1000}{1000}")
    for attempt in range(2):
        _add(engine, f"blown{attempt}", tokenizer, "hi", _params(spec, temperature=0.0, max_tokens=4))
        _add(engine, f"free{attempt}", tokenizer, "Hello", _params(None, temperature=0.0, max_tokens=6, ignore_eos=True))
        last = {}
        while engine.has_unfinished():
            for out in engine.step():
                last[out.request_id] = out
        blown, free = last[f"blown{attempt}"], last[f"free{attempt}"]
        assert (blown.finished, blown.finish_reason, blown.error_code) == (True, "error", "invalid_request")
        assert blown.error.startswith("the structured output's grammar failed") and "\n" not in blown.error
        assert free.finish_reason == "length" and free.completion_tokens == 6
    _no_leaks(engine)


def test_compiled_grammars_are_cached_by_key(engine, tokenizer):
    spec = StructuredOutputs.json_schema({**PERSON, "title": "cache test"})  # a key no other test uses
    compiler = engine.grammars.compiler
    misses, hits = compiler.misses, compiler.hits
    for k in range(3):
        _add(engine, f"r{k}", tokenizer, "Person:", _params(spec, temperature=1.0, seed=k))
    drain(engine)
    assert (compiler.misses - misses, compiler.hits - hits) == (1, 2)
    _no_leaks(engine)


def test_min_tokens_masks_eos_while_the_grammar_allows_more_and_a_complete_output_stops(engine, tokenizer):
    """vLLM's semantics (its terminal grammars stop under min_tokens): EOS is masked until
    min_tokens while the grammar allows another token (digits go on past where EOS would
    have been sampled), and an output the grammar has completed ends with "stop", never an
    error or text outside the grammar, before min_tokens (the gateway refuses a choice
    that can never reach it)."""
    digits, complete = StructuredOutputs.from_regex("[0-9]+"), StructuredOutputs.json_schema({"type": "boolean"})
    for t in (0.0, 1.0):
        _add(engine, f"digits-{t}", tokenizer, "Answer:", _params(digits, temperature=t, seed=1, max_tokens=60,
                                                                   min_tokens=12))
        _add(engine, f"bool-{t}", tokenizer, "Answer:", _params(complete, temperature=t, seed=1, max_tokens=60,
                                                                 min_tokens=12))
    results = drain(engine)
    for t in (0.0, 1.0):
        run = results[f"digits-{t}"]
        assert run.finish_reason in ("stop", "length") and len(run.token_ids) >= 12 and run.text.isdigit(), run
        done = results[f"bool-{t}"]
        assert done.finish_reason == "stop" and done.text in ("true", "false"), done
    _no_leaks(engine)
