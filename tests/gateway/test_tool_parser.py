"""The tool-call parser (gateway/tools/parser.py): whole texts, and streams cut at every
character boundary (and at every pair of boundaries) giving the same content and calls."""

from __future__ import annotations

import json

import pytest

from gateway.tools.parser import ToolCallStream, parse_tool_calls

NAMES = {"get_weather", "now"}
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
# (text, expected content, expected [(name, arguments)]) for auto mode (not incremental)
CASES = [
    ("Paris is the capital.  ", "Paris is the capital.  ", []),
    (WEATHER, None, [("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    ("Let me check.\n" + WEATHER + "\n" + '<tool_call>{"name":"now","arguments":{}}</tool_call>\n',
     "Let me check.", [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("now", "{}")]),
    # arguments given as a JSON string holding an object, and keys in the other order
    ('<tool_call>{"arguments": "{\\"city\\": \\"Rome\\"}", "name": "get_weather"}</tool_call>',
     None, [("get_weather", '{"city": "Rome"}')]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    # not calls: an unknown name, bad JSON, arguments not an object, an unclosed block, a partial tag
    ('Hi <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> x',
     'Hi <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> x', []),
    ('<tool_call>{"name": "now", "arguments": {</tool_call>',
     '<tool_call>{"name": "now", "arguments": {</tool_call>', []),
    ('<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "now", "arguments": [1]}</tool_call>', []),
    ('a <tool_call>{"name": "now", "arguments": {', 'a <tool_call>{"name": "now", "arguments": {', []),
    ("x <tool_cal", "x <tool_cal", []),
    ("</tool_call> <tool_call><tool_call>", "</tool_call> <tool_call><tool_call>", []),
    # a string argument holding the closing tag's beginning and braces
    ('<tool_call>{"name": "now", "arguments": {"s": "}} </tool"}}</tool_call>', None,
     [("now", '{"s": "}} </tool"}')]),
    ("", "", []),
]


def _stream(text: str, cuts: list[int], incremental: bool) -> tuple[str | None, list, list[str]]:
    """Feed ``text`` cut at ``cuts``; (content or None when calls were made, calls, ids)."""
    stream = ToolCallStream(NAMES, incremental)
    bounds = [0, *cuts, len(text)]
    emitted = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    content, calls = "", {}
    for e in emitted:
        content += e.content
        for d in e.calls:
            if d.id is not None:
                assert d.index == len(calls) and d.arguments == "" and d.id.startswith("call_")
                calls[d.index] = [d.name, "", d.id]
            calls[d.index][1] += d.arguments
    listed = [(name, args) for name, args, _ in (calls[i] for i in sorted(calls))]
    return (content or None) if listed else content, listed, [c[2] for c in calls.values()]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_whole_text(text, content, calls):
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict) and call.id.startswith("call_")
        assert call.openai() == {"id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("text,content,calls", CASES)
def test_stream_cut_anywhere_gives_the_whole_text_result(text, content, calls, incremental):
    whole = parse_tool_calls(text, NAMES, incremental)
    expected = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    if not incremental:
        assert expected == (content, calls)
    assert _stream(text, list(range(1, len(text))), incremental)[:2] == expected  # char by char
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _stream(text, sorted({i, j}), incremental)[:2] == expected, (i, j)


def test_incremental_streams_arguments_before_the_block_closes():
    stream = ToolCallStream(NAMES, incremental=True)
    head = stream.feed('<tool_call>\n{"name":"get_weather","arguments":{"city":"Par')
    assert [(d.name, d.arguments) for d in head.calls] == [("get_weather", ""), (None, '{"city":"Par')]
    # a '}' may be the body's own (not the arguments'): held back until more comes
    assert [d.arguments for d in stream.feed('is"}').calls] == ['is"']
    tail = stream.feed("}\n</tool_call>")
    assert [d.arguments for d in tail.calls] == ["}"] and stream.calls[0].arguments == '{"city":"Paris"}'


def test_not_incremental_sends_a_call_once_its_block_closed():
    stream = ToolCallStream(NAMES)
    assert not stream.feed('<tool_call>{"name": "now", "arguments": {"a": 1}}')
    done = stream.feed("</tool_call>")
    assert [(d.index, d.name, d.arguments) for d in done.calls] == [(0, "now", ""), (0, None, '{"a": 1}')]
    assert done.calls[0].openai()["type"] == "function" and "id" not in done.calls[1].openai()


@pytest.mark.parametrize("text", ["<tool_call>" * 50, "<tool_call>{" + "[" * 5000 + "</tool_call>",
                                  '<tool_call>{"name": "now", "arguments": ' + "{" * 3000,
                                  "\udcff<tool_call>\x00</tool_call>", "}" * 100 + "</tool_call>"])
@pytest.mark.parametrize("incremental", [False, True])
def test_odd_output_never_raises(text, incremental):
    parsed = parse_tool_calls(text, NAMES, incremental)
    assert parsed.content is not None or parsed.calls
