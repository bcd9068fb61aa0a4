"""The link's ``Finished`` for a request's last output (worker/serve/fanout.py): an engine
error reaches the gateway with its message and code, which choose the client's answer
(gateway/errors.py ``from_worker``: ``invalid_request`` is a 400, anything else a 500)."""
from __future__ import annotations

from protos import common_pb2
from worker.engine.engine_types import RequestOutput
from worker.serve.fanout import finished_message


def _out(**kw) -> RequestOutput:
    return RequestOutput("r1", "", [], True, kw.pop("finish_reason", "error"), 3, 1, **kw)


def test_a_request_error_keeps_its_message_and_code():
    msg = finished_message(_out(error="the structured output's grammar failed: x", error_code="invalid_request"))
    assert msg.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert (msg.error, msg.error_code) == ("the structured output's grammar failed: x", "invalid_request")


def test_an_error_without_a_code_is_internal_and_a_plain_finish_has_none():
    assert finished_message(_out(error="boom")).error_code == "internal"
    plain = finished_message(_out(finish_reason="stop"))
    assert (plain.finish_reason, plain.error, plain.error_code) == (common_pb2.FINISH_REASON_STOP, "", "")
