"""Tool calls through the real gateway and the fake worker, whose ``SAY[text]SAY`` script
plays the model's output (tests/gateway/fake_worker.py): the request's fields reach the
prompt and the queue, the model's ``<tool_call>`` blocks come back as OpenAI ``tool_calls``
(responses and streams parsed with the ``openai`` package's models), and bad tool
definitions are 400s naming the field; the same over gRPC. The gateway here has a 4,096-token context: the
tool prompt does not fit the session gateway's 128."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from protos import common_pb2, inference_pb2, inference_pb2_grpc
from tests.gateway.fake_tokenizer import CharTokenizer
from tests.gateway.harness import start_gateway
from tests.gateway.test_openai_shapes import _no_extras
from tests.helpers.sse import sse_data

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["C", "F"]}},
                  "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def _say(text: str) -> list[dict]:
    return [{"role": "user", "content": f"SAY[{text}]SAY"}]


@pytest.fixture(scope="module")
def tool_gateway(redis_server):
    gw = start_gateway(redis_server.url, tokenizer=CharTokenizer(context_length=4096))
    yield gw
    gw.stop()


@pytest.fixture()
def client(tool_gateway, api_key):
    return openai.OpenAI(base_url=tool_gateway.rest_url + "/v1", api_key=api_key, max_retries=0,
                         timeout=10)


def _post(gw, key, body) -> httpx.Response:
    return httpx.post(gw.rest_url + "/v1/chat/completions", timeout=10,
                      json={"max_tokens": 200, **body}, headers={"Authorization": f"Bearer {key}"})


def _prompt(fake_worker) -> str:
    return "".join(chr(t) for t in fake_worker.requests[-1].prompt_token_ids)


def test_a_call_comes_back_as_tool_calls(tool_gateway, api_key, fake_worker):
    r = _post(tool_gateway, api_key, {"messages": _say("Checking.\n" + CALL), "tools": TOOLS})
    body = r.json()
    _no_extras(ChatCompletion.model_validate(body))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMS)
    # auto: the functions are in the prompt, nothing constrains the output
    prompt = _prompt(fake_worker)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt
    assert not fake_worker.requests[-1].sampling.HasField("structured_outputs")


def test_text_that_is_not_a_call_stays_text(tool_gateway, api_key):
    text = 'No call: <tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    body = _post(tool_gateway, api_key, {"messages": _say(text), "tools": TOOLS}).json()
    _no_extras(ChatCompletion.model_validate(body))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}  # no tool_calls key
    assert body["choices"][0]["finish_reason"] == "stop"


def test_only_calls_give_null_content(client):
    resp = client.chat.completions.create(model="test-model", messages=_say(CALL + "\n" + CALL),
                                          tools=TOOLS, max_tokens=200)
    message = resp.choices[0].message
    assert message.content is None and resp.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["get_weather"] * 2
    assert message.tool_calls[0].id != message.tool_calls[1].id


def test_stream_deltas_add_up_to_the_response(client):
    text = "Sure.\n" + CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    chunks = list(client.chat.completions.create(model="test-model", messages=_say(text), tools=TOOLS,
                                                 max_tokens=200, stream=True))
    for chunk in chunks:
        _no_extras(ChatCompletionChunk.model_validate(chunk.model_dump()))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    for d in deltas:  # one entry per call in a chunk, as OpenAI streams them
        indices = [tc.index for tc in d.tool_calls or ()]
        assert len(indices) == len(set(indices)), d.tool_calls
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls or ():
            if tc.id is not None:  # the first delta of a call: id, type, name
                assert tc.index not in calls and tc.type == "function" and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
    assert content == "Sure."
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert json.loads(calls[1]["arguments"]) == {}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_stream_cut_by_max_tokens_mid_call_keeps_the_text(client):
    chunks = list(client.chat.completions.create(model="test-model", messages=_say(CALL), tools=TOOLS,
                                                 max_tokens=10, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == CALL[:30] and not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_each_choice_is_parsed_on_its_own(tool_gateway, api_key):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "C@i"}}</tool_call>'
    body = _post(tool_gateway, api_key, {"messages": _say(call), "tools": TOOLS, "n": 3}).json()
    choices = sorted(body["choices"], key=lambda c: c["index"])
    cities = [json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])["city"] for c in choices]
    assert cities == ["C0", "C1", "C2"] and {c["finish_reason"] for c in choices} == {"tool_calls"}
    r = _post(tool_gateway, api_key, {"messages": _say(call), "tools": TOOLS, "n": 2, "stream": True})
    frames = [json.loads(d) for d in sse_data(r.text) if d != "[DONE]"]
    names = {(f["choices"][0]["index"], tc["function"]["name"]) for f in frames if f["choices"]
             for tc in f["choices"][0]["delta"].get("tool_calls", ()) if "id" in tc}
    assert names == {(0, "get_weather"), (1, "get_weather")}


@pytest.mark.parametrize("choice,names", [
    ("required", ["get_weather", "get_time"]),
    ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
])
def test_required_and_named_queue_the_grammar_of_a_call(tool_gateway, api_key, fake_worker, choice, names):
    r = _post(tool_gateway, api_key, {"messages": _say(CALL), "tools": TOOLS, "tool_choice": choice})
    assert r.status_code == 200, r.text
    grammar = fake_worker.requests[-1].sampling.structured_outputs.grammar
    assert grammar.startswith("start: call") and "%json" in grammar
    assert [n for n in ("get_weather", "get_time") if f'"{n}\\",' in grammar] == names


def test_none_leaves_tools_out_and_the_text_alone(tool_gateway, api_key, fake_worker):
    body = _post(tool_gateway, api_key, {"messages": _say(CALL), "tools": TOOLS,
                                         "tool_choice": "none"}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert "<tools>" not in _prompt(fake_worker)


def test_tool_results_go_back_into_the_prompt(tool_gateway, api_key, fake_worker):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
                *_say("It is 18 C.")]
    body = _post(tool_gateway, api_key, {"messages": messages, "tools": TOOLS}).json()
    assert body["choices"][0]["message"]["content"] == "It is 18 C."
    prompt = _prompt(fake_worker)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool><tool_response>\n18 C and sunny\n</tool_response>" in prompt  # CharTokenizer's template


BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_tools_are_400_naming_the_field(tool_gateway, api_key, extra, param):
    r = _post(tool_gateway, api_key, {"messages": _say("x"), **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def _grpc_tools() -> list:
    return [inference_pb2.Tool(function=inference_pb2.FunctionDefinition(
                name="get_weather", description="Weather now", parameters=json.dumps(WEATHER_PARAMS))),
            inference_pb2.Tool(type="function", function=inference_pb2.FunctionDefinition(name="get_time"))]


def _generate(gw, key, request) -> list:
    with grpc.insecure_channel(gw.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return list(stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),), timeout=10))


def test_grpc_tool_calls(tool_gateway, api_key, fake_worker):
    chat = inference_pb2.ChatMessages(messages=[
        inference_pb2.ChatMessage(role="assistant", tool_calls=[inference_pb2.ToolCall(
            id="call_0", function=inference_pb2.FunctionCall(name="get_time", arguments="{}"))]),
        inference_pb2.ChatMessage(role="tool", tool_call_id="call_0", content="noon"),
        inference_pb2.ChatMessage(role="user", content=f"SAY[Sure.\n{CALL}]SAY")])
    replies = _generate(tool_gateway, api_key, inference_pb2.GenerateRequest(
        chat=chat, tools=_grpc_tools(), sampling=common_pb2.SamplingParams(max_tokens=200),
        tool_choice=inference_pb2.ToolChoice(mode="auto")))
    assert "".join(r.text for r in replies) == "Sure."
    heads = [d for r in replies for d in r.tool_calls if d.id]
    assert [(d.index, d.name) for d in heads] == [(0, "get_weather")] and heads[0].id.startswith("call_")
    args = "".join(d.arguments for r in replies for d in r.tool_calls)
    assert json.loads(args) == {"city": "Paris", "unit": "C"}
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS and replies[-1].usage.completion_tokens
    prompt = _prompt(fake_worker)
    assert "<tool><tool_response>\nnoon\n</tool_response>" in prompt and '"name": "get_time"' in prompt
    _generate(tool_gateway, api_key, inference_pb2.GenerateRequest(
        chat=chat, tools=_grpc_tools(), tool_choice=inference_pb2.ToolChoice(function_name="get_time"),
        sampling=common_pb2.SamplingParams(max_tokens=200)))
    assert fake_worker.requests[-1].sampling.structured_outputs.grammar.startswith("start: call\n")


@pytest.mark.parametrize("request_fields,param", [
    ({"prompt": "hi", "tools": "ok"}, "tools"),
    ({"tools": [inference_pb2.Tool(function=inference_pb2.FunctionDefinition(name="f", parameters="{"))]},
     "tools[0].function.parameters"),
    ({"tool_choice": inference_pb2.ToolChoice(function_name="rm")}, "tool_choice"),
])
def test_grpc_bad_tools_are_invalid_argument(tool_gateway, api_key, request_fields, param):
    fields = dict(request_fields)
    if fields.get("tools") == "ok":
        fields["tools"] = _grpc_tools()
    if "prompt" not in fields:
        fields["chat"] = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="x")])
        fields.setdefault("tools", _grpc_tools())
    with pytest.raises(grpc.RpcError) as info:
        _generate(tool_gateway, api_key, inference_pb2.GenerateRequest(**fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and param in info.value.details()


def test_a_chunk_holds_one_entry_per_call_index():
    """The parser's deltas of one step merged by index (arguments appended, the first's id,
    type and name kept): a hand-written client reading ``tool_calls[0]`` sees them all."""
    from gateway.rest.openai_format import merged_call_deltas

    opened = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert merged_call_deltas([opened, {"index": 0, "function": {"arguments": '{"'}},
                               {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g"}},
                               {"index": 0, "function": {"arguments": 'a"'}}]) == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g"}}]
