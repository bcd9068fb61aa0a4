"""Parameter validation table (no Redis, no network)."""

import math

import pytest

from gateway.errors import InvalidRequestError, NotFoundError
from gateway.admission.params import RequestParams
from gateway.admission.validation import RequestLimits, validate_request
from tests.gateway.fake_tokenizer import CharTokenizer

TOK = CharTokenizer()  # vocab 300, context 128
LIMITS = RequestLimits(served_model="m", default_max_tokens=512)


def ok(**kw):
    kw.setdefault("prompt", "hello")
    return validate_request(TOK, LIMITS, RequestParams(**kw))


@pytest.mark.parametrize("kw,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 124}, "max_tokens"),  # 5 + 124 > 128
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 301}, "top_k"), ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop": "x" * 257}, "stop"), ({"stop": 3}, "stop"),
    ({"seed": 1.5}, "seed"), ({"prompt": ""}, "prompt"), ({"prompt": "x" * 128}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 999]}, "prompt"),
    ({"return_logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"return_logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": None, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"prompt": None, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"prompt": None, "messages": []}, "messages"),
])
def test_rejections_name_the_parameter(kw, param):
    with pytest.raises(InvalidRequestError) as info:
        ok(**kw)
    assert info.value.param == param


def test_defaults_and_accepted_values():
    r = ok()
    assert r.max_tokens == 128 - 5 and r.prompt_tokens == 5 and r.kind == "completion"
    assert ok(max_tokens=None, prompt="x" * 120).max_tokens == 8
    r = ok(max_tokens=123, temperature=0, top_p=1, top_k=-1, seed=7, stop="\n")
    assert (r.max_tokens, r.top_k, r.stop, r.seed) == (123, 0, ("\n",), 7)
    assert ok(top_k=300).top_k == 300
    params = r.sampling_params()
    assert params.max_tokens == 123 and params.HasField("temperature") and not params.logprobs
    chat = ok(prompt=None, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert chat.kind == "chat" and chat.prompt_tokens == len("<user>hi\n<assistant>")


def test_n_up_to_the_cap_is_queued_as_sampling_n():
    assert ok().n == 1 and ok().sampling_params().n == 0  # one choice: the field stays unset
    assert ok(n=1).n == 1 and ok(n=2.0).n == 2
    r = ok(n=16)
    assert r.n == 16 and r.sampling_params().n == 16
    capped = RequestLimits(served_model="m", max_n=4)
    assert validate_request(TOK, capped, RequestParams(prompt="hi", n=4)).n == 4
    with pytest.raises(InvalidRequestError) as info:
        validate_request(TOK, capped, RequestParams(prompt="hi", n=5))
    assert info.value.param == "n" and "[1, 4]" in info.value.message


def test_cost_is_prompt_plus_n_times_max_tokens():
    from gateway.admission.key_limits import cost_tokens
    assert cost_tokens(ok(max_tokens=10)) == 5 + 10
    assert cost_tokens(ok(max_tokens=10, n=4)) == 5 + 4 * 10


def test_caps_and_model():
    capped = RequestLimits(served_model="m", max_max_tokens=10, max_prompt_tokens=4)
    with pytest.raises(InvalidRequestError):
        validate_request(TOK, capped, RequestParams(prompt="hi", max_tokens=11))
    with pytest.raises(InvalidRequestError):
        validate_request(TOK, capped, RequestParams(prompt="hello"))
    assert validate_request(TOK, capped, RequestParams(prompt="hi")).max_tokens == 10
    with pytest.raises(NotFoundError):
        ok(model="gpt-4")
