"""``common.sampling``: one table of the sampling parameters drives the gateway (REST and
gRPC validation, the REST schema) and the worker (the queued protobuf → the engine's
``SamplingParams`` and its own check), so the two sides cannot drift."""

from dataclasses import fields

import pytest

from common.sampling import PARAMS, Sampling, SamplingError
from gateway.admission.validation import RequestLimits, validate_request
from gateway.errors import InvalidRequestError
from gateway.grpc_server import request_params
from gateway.rest import schemas
from gateway.rest.params import completion_params
from protos import common_pb2, inference_pb2
from tests.gateway.fake_tokenizer import CharTokenizer
from worker.engine.sampling_params import SamplingParams
from worker.serve.request_codec import to_sampling_params

TOK = CharTokenizer()  # vocab 300, context 128
LIMITS = RequestLimits(served_model="m", default_max_tokens=16)

# Out of range, each exact in float32 (the queue's type), so both sides print the same value.
OUT_OF_RANGE = [
    ("temperature", -1.0), ("top_p", 1.5), ("top_k", 301), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("repetition_penalty", -1.0), ("min_p", 1.5),
    ("min_tokens", 17),  # above max_tokens (16)
]


def _rest_error(name, value) -> InvalidRequestError:
    body = schemas.CompletionRequest(prompt="hello", max_tokens=16, **{name: value})
    with pytest.raises(InvalidRequestError) as info:
        validate_request(TOK, LIMITS, completion_params(body))
    return info.value


def _grpc_error(proto) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        validate_request(TOK, LIMITS, request_params(inference_pb2.GenerateRequest(prompt="hello", sampling=proto)))
    return info.value


def _worker_error(proto) -> SamplingError:
    with pytest.raises(SamplingError) as info:
        to_sampling_params(proto).validate(TOK.vocab_size)
    return info.value


def test_the_table_covers_every_out_of_range_case_here():
    assert {p.name for p in PARAMS} - {"seed"} == {name for name, _ in OUT_OF_RANGE}


@pytest.mark.parametrize("name, value", OUT_OF_RANGE)
def test_rest_grpc_and_the_worker_refuse_with_the_same_message(name, value):
    proto = common_pb2.SamplingParams(max_tokens=16, **{name: value})
    rest, grpc, worker = _rest_error(name, value), _grpc_error(proto), _worker_error(proto)
    assert rest.param == grpc.param == worker.param == name
    assert rest.message == grpc.message == worker.message == str(worker)
    assert name in rest.message and str(value) in rest.message


@pytest.mark.parametrize("name, value", [("stop_token_ids", [300]), ("logit_bias", {5: 101.5})])
def test_the_lists_and_maps_are_refused_alike(name, value):
    proto = common_pb2.SamplingParams(max_tokens=16, **{name: value})
    grpc, worker = _grpc_error(proto), _worker_error(proto)
    assert grpc.param == worker.param == name and grpc.message == worker.message


def test_the_rest_schema_documents_the_tables_ranges():
    props = schemas.ChatCompletionRequest.model_json_schema()["properties"]
    for p in PARAMS:
        assert p.name in props, p.name
        for key, bound in (p.json_schema or {}).items():
            assert props[p.name][key] == bound, p.name


# Every field set, none at a default; each value exact in float32.
REST_BODY = dict(prompt="hello", max_tokens=8, temperature=0.5, top_p=0.75, top_k=40, seed=-7,
                 stop=["x", "yz"], stop_token_ids=[5, 9], ignore_eos=True, skip_special_tokens=False,
                 logprobs=2, presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.25,
                 min_p=0.0625, min_tokens=3, logit_bias={"7": -100, "3": 2.5})
EXPECTED = Sampling(max_tokens=8, temperature=0.5, top_p=0.75, top_k=40, seed=-7, stop=("x", "yz"),
                    stop_token_ids=(5, 9), ignore_eos=True, logprobs=2, return_logprobs=True,
                    skip_special_tokens=False, presence_penalty=0.5, frequency_penalty=-1.5,
                    repetition_penalty=1.25, min_p=0.0625, min_tokens=3,
                    logit_bias=((3, 2.5), (7, -100.0)))


def test_rest_body_to_queue_to_worker_round_trips_every_field():
    default, resolved = Sampling(), SamplingParams()
    for f in fields(Sampling):  # the case really covers every field
        assert getattr(EXPECTED, f.name) not in (getattr(default, f.name), getattr(resolved, f.name)), f.name
    validated = validate_request(TOK, LIMITS, completion_params(schemas.CompletionRequest(**REST_BODY)))
    assert validated.sampling == EXPECTED
    queued = common_pb2.SamplingParams.FromString(validated.sampling_params().SerializeToString())
    worker = to_sampling_params(queued)
    assert worker == SamplingParams(**{f.name: getattr(EXPECTED, f.name) for f in fields(Sampling)})
    worker.validate(TOK.vocab_size)
    assert Sampling.from_proto(queued) == EXPECTED and EXPECTED.to_proto() == queued


def test_unsent_fields_queue_unset_and_take_the_tables_defaults_on_the_worker():
    validated = validate_request(TOK, LIMITS, completion_params(schemas.CompletionRequest(
        prompt="hello", presence_penalty=0.0, repetition_penalty=1.0, top_k=-1)))
    queued = validated.sampling_params()
    for p in PARAMS:
        if p.proto_optional and p.name != "top_k":  # top_k -1 (off) is queued as 0
            assert not queued.HasField(p.name), p.name
    worker = to_sampling_params(queued)
    assert worker == SamplingParams(max_tokens=16)
    for p in PARAMS:
        assert getattr(worker, p.name) == p.default, p.name
    assert not worker.penalizes and worker.temperature == 1.0


def test_a_finite_number_beyond_float32_is_not_called_infinite():
    """temperature 1e308 is finite: the 400 said "must be a finite number, got 1e+308"; it
    names the 32-bit range the value must fit instead. NaN and inf still say "finite"."""
    from common.sampling import number
    with pytest.raises(SamplingError) as info:
        number("temperature", 1e308)
    assert "finite" not in info.value.message and "3.403e+38" in info.value.message
    assert info.value.param == "temperature"
    for value in (float("nan"), float("inf"), 10 ** 400):
        with pytest.raises(SamplingError, match="must be a finite number"):
            number("temperature", value)


def test_a_grpc_request_without_input_names_both_inputs():
    """An empty GenerateRequest was told "'prompt' is required" (REST completions' words);
    gRPC's input is a prompt or chat messages, and the error says so."""
    with pytest.raises(InvalidRequestError) as info:
        request_params(inference_pb2.GenerateRequest())
    assert "'prompt' or 'chat'" in info.value.message and info.value.param == "prompt"
