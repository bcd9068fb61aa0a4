"""vLLM extensions (top_k, ignore_eos, stop_token_ids, skip_special_tokens) and the sampling
controls (penalties, min_p, min_tokens, logit_bias) reach the queue."""

import grpc
import httpx
import pytest

from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.gateway.conftest import wait_for


def _queued(fake_worker, n_before):
    assert wait_for(lambda: len(fake_worker.requests) > n_before)
    return fake_worker.requests[-1].sampling


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
])
def test_rest_extensions_are_queued(gateway, api_key, fake_worker, path, body):
    n = len(fake_worker.requests)
    extra = {"top_k": 7, "ignore_eos": True, "stop_token_ids": [3, 299],
             "skip_special_tokens": False, "max_tokens": 4}
    r = httpx.post(gateway.rest_url + path, json={**body, **extra},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert r.status_code == 200, r.text
    s = _queued(fake_worker, n)
    assert (s.top_k, s.ignore_eos, list(s.stop_token_ids), s.skip_special_tokens) == (
        7, True, [3, 299], False)


def test_rest_defaults(gateway, api_key, fake_worker):
    n = len(fake_worker.requests)
    r = httpx.post(gateway.rest_url + "/v1/completions", json={"prompt": "hi"},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert r.status_code == 200
    s = _queued(fake_worker, n)
    assert (s.ignore_eos, list(s.stop_token_ids), s.skip_special_tokens) == (False, [], True)
    assert not s.HasField("top_k")


@pytest.mark.parametrize("extra,param", [
    ({"stop_token_ids": [300]}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
])
def test_rest_extension_errors(gateway, api_key, extra, param):
    r = httpx.post(gateway.rest_url + "/v1/completions", json={"prompt": "hi", **extra},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_grpc_extensions_are_queued(gateway, api_key, fake_worker):
    n = len(fake_worker.requests)
    with grpc.insecure_channel(gateway.grpc_target) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        sampling = common_pb2.SamplingParams(max_tokens=2, top_k=5, ignore_eos=True,
                                             stop_token_ids=[1, 2])
        list(stub.Generate(inference_pb2.GenerateRequest(prompt="hi", sampling=sampling),
                           metadata=(("authorization", f"Bearer {api_key}"),), timeout=10))
        with pytest.raises(grpc.RpcError) as info:
            bad = common_pb2.SamplingParams(stop_token_ids=[10_000])
            list(stub.Generate(inference_pb2.GenerateRequest(prompt="hi", sampling=bad),
                               metadata=(("authorization", f"Bearer {api_key}"),), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    s = fake_worker.requests[n].sampling
    assert (s.top_k, s.ignore_eos, list(s.stop_token_ids), s.skip_special_tokens) == (
        5, True, [1, 2], True)


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
])
def test_unsupported_openai_features_are_400_not_ignored(gateway, api_key, path, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(gateway.rest_url + path, json={**body, "max_tokens": 2, **extra},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "unsupported_parameter"


def test_neutral_values_of_unsupported_features_are_accepted(gateway, api_key):
    r = httpx.post(gateway.rest_url + "/v1/chat/completions", timeout=10, headers={"Authorization": f"Bearer {api_key}"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [],
                         "tool_choice": "none", "logit_bias": {}, "response_format": {"type": "text"},
                         "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                         "min_tokens": 0, "min_p": 0, "best_of": 1})
    assert r.status_code == 200, r.text


SAMPLING_CONTROLS = {"presence_penalty": 0.5, "frequency_penalty": -1.5, "repetition_penalty": 1.25,
                     "min_p": 0.5, "min_tokens": 2, "logit_bias": {"7": -100, "42": 3.5}}


def _assert_controls(s):
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (
        0.5, -1.5, 1.25, 0.5)
    assert s.min_tokens == 2 and dict(s.logit_bias) == {7: -100.0, 42: 3.5}


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
])
def test_rest_sampling_controls_are_queued(gateway, api_key, fake_worker, path, body):
    n = len(fake_worker.requests)
    r = httpx.post(gateway.rest_url + path, json={**body, **SAMPLING_CONTROLS, "max_tokens": 4},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert r.status_code == 200, r.text
    _assert_controls(_queued(fake_worker, n))


@pytest.mark.parametrize("extra,param", [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 2}, "min_p"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"300": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
])
def test_rest_sampling_control_errors(gateway, api_key, extra, param):
    r = httpx.post(gateway.rest_url + "/v1/completions", json={"prompt": "hi", **extra},
                   headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_grpc_sampling_controls_are_queued_and_validated(gateway, api_key, fake_worker):
    n = len(fake_worker.requests)
    auth = (("authorization", f"Bearer {api_key}"),)
    with grpc.insecure_channel(gateway.grpc_target) as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        sampling = common_pb2.SamplingParams(
            max_tokens=4, presence_penalty=0.5, frequency_penalty=-1.5, repetition_penalty=1.25,
            min_p=0.5, min_tokens=2, logit_bias={7: -100, 42: 3.5})
        list(stub.Generate(inference_pb2.GenerateRequest(prompt="hi", sampling=sampling),
                           metadata=auth, timeout=10))
        _assert_controls(_queued(fake_worker, n))
        for bad, param in ((common_pb2.SamplingParams(presence_penalty=2.5), "presence_penalty"),
                           (common_pb2.SamplingParams(repetition_penalty=0), "repetition_penalty"),
                           (common_pb2.SamplingParams(min_p=float("nan")), "min_p"),
                           (common_pb2.SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
                           (common_pb2.SamplingParams(logit_bias={300: 1}), "logit_bias"),
                           (common_pb2.SamplingParams(logit_bias={5: 1000}), "logit_bias")):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(inference_pb2.GenerateRequest(prompt="hi", sampling=bad),
                                   metadata=auth, timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, param
            assert param in info.value.details()
