"""The official ``openai`` client works unchanged against the REST front."""

import openai
import pytest


@pytest.fixture()
def client(gateway, api_key):
    return openai.OpenAI(base_url=gateway.rest_url + "/v1", api_key=api_key, max_retries=0,
                         timeout=10)


def test_chat_non_streaming(client):
    resp = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert resp.choices[0].message.content == "w0 w1 w2 "
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 3


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "w0 w1 w2 w3 w4 " and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions_both_ways(client):
    resp = client.completions.create(model="test-model", prompt="hello", max_tokens=2)
    assert resp.choices[0].text == "w0 w1 " and resp.usage.prompt_tokens == 5
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="test-model", prompt="hello", max_tokens=2, stream=True))
    assert text == "w0 w1 "


def test_models_and_errors(client):
    assert [m.id for m in client.models.list()] == ["test-model"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="test-model", prompt="hello", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hello")
    bad = openai.OpenAI(base_url=client.base_url, api_key="sk-inflight-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
