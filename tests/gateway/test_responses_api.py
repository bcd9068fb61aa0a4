"""``/v1/responses`` (OpenAI's Responses API) through the real gateway, real Redis and the
fake worker, whose ``SAY[text]SAY`` script plays the model's output
(tests/gateway/fake_worker.py), checked with the ``openai`` package's ``responses``
resource: text, streaming events, function tools and their round trip with
``previous_response_id``, the store's per-key isolation, and 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import redis
from openai.types.responses import Response

from gateway import keys
from tests.gateway.fake_tokenizer import CharTokenizer
from tests.gateway.harness import start_gateway

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _say(text: str) -> str:
    return f"SAY[{text}]SAY"


@pytest.fixture(scope="module")
def responses_gateway(redis_server):
    gw = start_gateway(redis_server.url, tokenizer=CharTokenizer(context_length=4096))
    yield gw
    gw.stop()


@pytest.fixture()
def client(responses_gateway, api_key):
    return openai.OpenAI(base_url=responses_gateway.rest_url + "/v1", api_key=api_key, max_retries=0,
                         timeout=10)


def _prompt(fake_worker) -> str:
    return "".join(chr(t) for t in fake_worker.requests[-1].prompt_token_ids)


def test_text_response(client, fake_worker):
    resp = client.responses.create(model="test-model", input=_say("Hello there"), instructions="Be brief.",
                                   max_output_tokens=50, temperature=0.5, top_p=0.9)
    assert isinstance(resp, Response) and resp.status == "completed" and resp.object == "response"
    assert resp.output_text == "Hello there" and resp.id.startswith("resp_")
    assert resp.usage.input_tokens == len(fake_worker.requests[-1].prompt_token_ids) > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    prompt = _prompt(fake_worker)
    assert prompt.startswith("<system>Be brief.\n<user>SAY[")
    sampling = fake_worker.requests[-1].sampling
    assert sampling.max_tokens == 50 and abs(sampling.temperature - 0.5) < 1e-6


def test_incomplete_at_max_output_tokens(client):
    resp = client.responses.create(model="test-model", input=_say("a long answer here"), max_output_tokens=2)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "a long"


def test_stream_events(client):
    events = list(client.responses.create(model="test-model", input=_say("Streamed words"), stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "Streamed words"
    assert events[-1].response.output_text == "Streamed words"


def test_stream_helper(client):
    with client.responses.stream(model="test-model", input=_say("Via the helper")) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == "Via the helper" == final.output_text


def test_function_call_round_trip(client, fake_worker):
    first = client.responses.create(model="test-model", input=_say(CALL), tools=[WEATHER])
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    second = client.responses.create(
        model="test-model", previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"},
               {"role": "user", "content": _say("It is 18C.")}])
    assert second.output_text == "It is 18C." and second.previous_response_id == first.id
    prompt = _prompt(fake_worker)
    # the first turn's call and its output are in the second prompt, in order
    assert prompt.index('"name": "get_weather"') < prompt.index("<tool_response>\n18C, sunny")


def test_stream_function_call_events(client):
    events = list(client.responses.create(model="test-model", input=_say("Let me check.\n" + CALL),
                                          tools=[WEATHER], tool_choice="auto", stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == json.loads(done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [i.type for i in final.output] == ["message", "function_call"]


def test_store_is_per_key_and_ttl(client, responses_gateway, redis_url):
    resp = client.responses.create(model="test-model", input=_say("kept"))
    assert client.responses.retrieve(resp.id).output_text == "kept"
    r = redis.Redis.from_url(redis_url)
    (name,) = r.keys(f"inflight:responses:*:{resp.id}")
    assert 0 < r.ttl(name) <= 86400
    _, other = keys.create_key(r, "tenant-b", "other")
    r.close()
    stranger = openai.OpenAI(base_url=responses_gateway.rest_url + "/v1", api_key=other, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.create(model="test-model", input="hi", previous_response_id=resp.id)
    with pytest.raises(openai.NotFoundError):
        stranger.responses.delete(resp.id)
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_store_false_keeps_nothing(client, redis_url):
    resp = client.responses.create(model="test-model", input=_say("not kept"), store=False)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_text_format_json_schema_reaches_the_queue(client, fake_worker):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    resp = client.responses.create(model="test-model", input=_say('{"x": 1}'), text={
        "format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert json.loads(resp.output_text) == {"x": 1}
    assert fake_worker.requests[-1].sampling.HasField("structured_outputs")


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": "10"}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    # errors of the chat path beneath name the Responses API's fields, not chat's
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x" * 5000}, "input"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name", "parameters": {"type": "object"}}]},
     "tools[0].name"),
])
def test_bad_requests_name_the_field(responses_gateway, api_key, body, param):
    r = httpx.post(responses_gateway.rest_url + "/v1/responses", json=body, timeout=10,
                   headers={"Authorization": f"Bearer {api_key}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert "max_tokens" not in r.json()["error"]["message"] and ".function" not in r.json()["error"]["message"]


def test_function_call_output_needs_its_function_call(client, responses_gateway, api_key):
    """A ``function_call_output`` whose ``call_id`` names no ``function_call`` of the input or of
    the previous response is OpenAI's 400 on ``input``; one of the input or of the previous
    response passes."""
    def post(body):
        return httpx.post(responses_gateway.rest_url + "/v1/responses", timeout=10,
                          headers={"Authorization": f"Bearer {api_key}"}, json={"model": "test-model", **body})

    orphan = {"type": "function_call_output", "call_id": "call_nope", "output": "18C"}
    r = post({"input": [orphan, {"role": "user", "content": _say("ok")}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input" and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"] == "No tool call found for function call output with call_id call_nope."
    first = client.responses.create(model="test-model", input=_say(CALL), tools=[WEATHER])
    r = post({"previous_response_id": first.id, "tools": [WEATHER], "input": [orphan]})
    assert r.status_code == 400 and "call_nope" in r.json()["error"]["message"], r.text
    call = {"type": "function_call", "call_id": "call_mine", "name": "get_weather", "arguments": "{}"}
    r = post({"tools": [WEATHER], "input": [call, {**orphan, "call_id": "call_mine"},
                                             {"role": "user", "content": _say("fine")}]})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "fine", r.text
