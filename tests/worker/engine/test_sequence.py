"""SamplingParams validation, Sequence lifecycle and EngineConfig checks."""

import pytest

from worker.engine.engine_config import EngineConfig
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import FINISH_REASONS, Sequence, SequenceStatus as S


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 1000}, "top_k"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [500]}, "stop_token_ids"), ({"logprobs": 21}, "logprobs"),
])
def test_validate_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate(vocab_size=400)


def test_params_normalize_lists():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1])
    assert p.stop == ("a", "b") and p.stop_token_ids == (1,)
    assert SamplingParams(stop="x").stop == ("x",)
    SamplingParams(top_k=-1, temperature=0).validate(400)


def test_lifecycle_and_finish_reasons():
    seq = Sequence(0, "r", [1, 2, 3], SamplingParams())
    seq.set_status(S.RUNNING)
    seq.num_computed_tokens = 3
    seq.output_token_ids.append(7)
    assert seq.is_decode and seq.token_slice(2, 4) == [3, 7]
    seq.set_status(S.PREEMPTED)
    assert seq.num_computed_tokens == 0 and seq.num_preemptions == 1 and seq.is_waiting
    seq.set_status(S.RUNNING)
    seq.set_status(S.FINISHED_LENGTH)
    assert seq.finish_reason == "length" and seq.is_finished
    with pytest.raises(ValueError, match="illegal transition"):
        seq.set_status(S.RUNNING)
    assert set(FINISH_REASONS.values()) == {"stop", "length", "abort", "error"}


def test_config_checks():
    with pytest.raises(ValueError, match="batching"):
        EngineConfig(batching="bogus")
    assert EngineConfig(batching="static").request_batch_size == 8
    assert EngineConfig(batching="dynamic").request_batch_size == 32
    assert EngineConfig(batching="static").max_wait_s == float("inf")
