"""The streaming REST client folds SSE chunks into a StreamResult, mid-stream errors included."""

from __future__ import annotations

from stack.clients import StreamResult, _apply_sse_chunk


def test_deltas_finish_and_usage_are_recorded():
    result = StreamResult("rest", "p")
    _apply_sse_chunk(result, {"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, 0.5)
    _apply_sse_chunk(result, {"choices": [{"delta": {}, "finish_reason": "length"}]}, 0.7)
    _apply_sse_chunk(result, {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}}, 0.7)
    assert (result.text, result.ttft_s, result.finish_reason) == ("Hi", 0.5, "length")
    assert (result.completion_tokens, result.prompt_tokens, result.error) == (2, 5, None)


def test_a_mid_stream_error_is_an_error_not_a_silent_end():
    result = StreamResult("rest", "p")
    _apply_sse_chunk(result, {"choices": [{"delta": {"content": "Hi"}}]}, 0.5)
    _apply_sse_chunk(result, {"error": {"message": "the worker disconnected", "type": "service_unavailable_error",
                                        "code": "unavailable"}}, 0.9)
    assert result.error == "stream error unavailable: the worker disconnected"
    assert result.finish_reason is None and result.text == "Hi"
