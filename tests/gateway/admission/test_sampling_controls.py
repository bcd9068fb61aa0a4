"""Penalties, min_p, min_tokens and logit_bias: validation and the queued SamplingParams
(no Redis, no network)."""

import math

import pytest

from gateway.admission.params import RequestParams
from gateway.admission.validation import RequestLimits, validate_request
from gateway.errors import InvalidRequestError
from tests.gateway.fake_tokenizer import CharTokenizer

TOK = CharTokenizer()  # vocab 300, context 128
LIMITS = RequestLimits(served_model="m", default_max_tokens=16)


def ok(**kw):
    kw.setdefault("prompt", "hello")
    return validate_request(TOK, LIMITS, RequestParams(**kw))


@pytest.mark.parametrize("kw,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"), ({"presence_penalty": "1"}, "presence_penalty"),
    ({"frequency_penalty": -50}, "frequency_penalty"), ({"frequency_penalty": math.inf}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32, the queue's type
    ({"repetition_penalty": 1e39}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"min_p": math.nan}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # above the default max_tokens (16)
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {"300": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"1.0": 1}}, "logit_bias"), ({"logit_bias": {"١": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": math.nan}}, "logit_bias"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": None}}, "logit_bias"), ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {10**30: 1}}, "logit_bias"),
])
def test_rejections_name_the_parameter(kw, param):
    with pytest.raises(InvalidRequestError) as info:
        ok(**kw)
    assert info.value.param == param and param in info.value.message


def test_values_reach_the_queued_sampling_params():
    r = ok(presence_penalty=0.5, frequency_penalty=-2, repetition_penalty=1.3, min_p=0.05,
           min_tokens=3, max_tokens=8, logit_bias={"7": -100, "3": 2.5, "299": 100})
    s = r.sampling_params()
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -2
    assert s.repetition_penalty == pytest.approx(1.3) and s.min_p == pytest.approx(0.05)
    assert s.min_tokens == 3 and dict(s.logit_bias) == {3: 2.5, 7: -100.0, 299: 100.0}
    assert ok(logit_bias={i: 1 for i in range(300)}).logit_bias[-1] == (299, 1.0)  # gRPC: int keys
    assert ok(min_tokens=16).min_tokens == 16  # = the default max_tokens


def test_neutral_values_leave_the_fields_unset():
    for r in (ok(), ok(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1, min_p=0,
                       min_tokens=0, logit_bias={})):
        s = r.sampling_params()
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            assert not s.HasField(name), name
        assert s.min_tokens == 0 and not s.logit_bias


def test_chat_top_logprobs_up_to_20():
    chat = dict(prompt=None, messages=[{"role": "user", "content": "hi"}], return_logprobs=True)
    assert ok(**chat, top_logprobs=20).top_logprobs == 20
    with pytest.raises(InvalidRequestError):
        ok(**chat, top_logprobs=21)
