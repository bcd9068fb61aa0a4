"""Worker logprobs → OpenAI's chat ``logprobs`` object."""

from gateway.rest.openai_format import chat_logprobs, completion_logprobs
from protos import common_pb2


def test_chat_logprobs_bytes_are_the_tokens_raw_bytes():
    """A token that splits a character shows U+FFFD as its text; its ``bytes`` are the
    raw bytes the worker sent, so a client can join them back into the character."""
    items = [common_pb2.TokenLogprob(token="\ufffd", logprob=-0.5, token_bytes="你".encode()[:2],
                                     top=[common_pb2.TopLogprob(token="\ufffd", logprob=-0.5,
                                                                token_bytes="你".encode()[:2])]),
             common_pb2.TokenLogprob(token="\ufffd", logprob=-0.25, token_bytes="你".encode()[2:])]
    content = chat_logprobs(items)["content"]
    assert bytes(content[0]["bytes"] + content[1]["bytes"]).decode() == "你"
    assert content[0]["top_logprobs"][0]["bytes"] == content[0]["bytes"]
    assert content[1]["token"] == "\ufffd" and content[1]["logprob"] == -0.25


def test_chat_logprobs_without_bytes_from_the_worker_encode_the_text():
    """A worker from before ``token_bytes`` sends none: the text's UTF-8 stands in."""
    content = chat_logprobs([common_pb2.TokenLogprob(token=" Paris", logprob=-0.1)])["content"]
    assert content[0]["bytes"] == list(b" Paris") and content[0]["top_logprobs"] == []
    assert chat_logprobs([]) is None


def _token(text: str, logprob: float, *top: tuple[str, float]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token=text, logprob=logprob,
                                   top=[common_pb2.TopLogprob(token=t, logprob=lp) for t, lp in top])


def test_completion_top_logprobs_hold_the_sampled_token_and_the_top_n():
    """Legacy ``logprobs: N``: each token's ``top_logprobs`` has the sampled token, first, and
    the N most likely (OpenAI and vLLM: N + 1 entries when the sampled one is not among
    them, N when it is, one with ``logprobs: 0``)."""
    items = [_token(" Paris", -0.125, (" Paris", -0.125), (" Lyon", -2.5)),   # greedy: among the top 2
             _token(" is", -3.0, (" was", -0.5), (" remains", -1.0)),     # sampled outside them
             _token("!", -0.25)]                                             # logprobs: 0
    top = completion_logprobs(items)["top_logprobs"]
    assert top[0] == {" Paris": -0.125, " Lyon": -2.5}
    assert top[1] == {" is": -3.0, " was": -0.5, " remains": -1.0} and next(iter(top[1])) == " is"
    assert top[2] == {"!": -0.25}
