"""StreamBuffer: the stream interval's chunking rules (worker/serve/stream_interval.py)."""

from __future__ import annotations

import pytest

from protos import common_pb2
from worker.serve.stream_interval import StreamBuffer


def _push(buf: StreamBuffer, token: int, finished: bool = False, rid: str = "r"):
    logprob = [common_pb2.TokenLogprob(token_id=token, logprob=-0.5)]
    return buf.push(rid, f"<{token}>", [token], logprob, finished)


def test_interval_one_sends_every_token():
    buf = StreamBuffer(1)
    deltas = [_push(buf, t, finished=(t == 2)) for t in range(3)]
    assert [list(d.token_ids) for d in deltas] == [[0], [1], [2]]
    assert len(buf) == 0


def test_first_token_alone_then_full_chunks_then_the_rest_with_the_finish():
    buf = StreamBuffer(3)
    sent = [d for t in range(8) if (d := _push(buf, t, finished=(t == 7))) is not None]
    assert [list(d.token_ids) for d in sent] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert [d.text for d in sent] == ["<0>", "<1><2><3>", "<4><5><6>", "<7>"]
    assert [lp.token_id for lp in sent[1].logprobs] == [1, 2, 3]
    assert len(buf) == 0  # forgotten after its last output


def test_requests_are_chunked_independently():
    buf = StreamBuffer(2)
    assert _push(buf, 0, rid="a") is not None and _push(buf, 0, rid="b") is not None
    assert _push(buf, 1, rid="a") is None
    assert list(_push(buf, 2, rid="a").token_ids) == [1, 2]
    assert _push(buf, 1, rid="b") is None


def test_drop_discards_held_tokens():
    buf = StreamBuffer(4)
    _push(buf, 0)
    _push(buf, 1)
    buf.drop("r")
    assert len(buf) == 0
    assert list(_push(buf, 2).token_ids) == [2]  # a new stream: its first token goes out at once


def test_finish_without_new_tokens_flushes_held_ones_or_sends_nothing():
    buf = StreamBuffer(4)
    _push(buf, 0)
    _push(buf, 1)
    delta = buf.push("r", "", [], [], True)
    assert list(delta.token_ids) == [1] and delta.text == "<1>"
    assert buf.push("q", "", [], [], True) is None


@pytest.mark.parametrize("interval", [0, -2])
def test_interval_below_one_is_refused(interval):
    with pytest.raises(ValueError, match="stream interval must be >= 1"):
        StreamBuffer(interval)
