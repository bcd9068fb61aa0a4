"""``--runner`` and ``--pooler-config`` (vLLM's names) from the command line to the settings,
and their one-line refusals before anything loads; a queued embeddings entry reaching the
engine as a pooling request."""

from __future__ import annotations

import argparse

import pytest

from common.worker_options import WorkerOptions, add_worker_options
from protos import common_pb2, queue_pb2
from worker.engine.engine_types import PoolingParams
from worker.engine.pooler import PoolerConfig
from worker.serve.options import to_settings
from worker.serve.request_codec import to_engine_request


def _options(argv: list[str]) -> WorkerOptions:
    parser = argparse.ArgumentParser()
    add_worker_options(parser)
    return WorkerOptions.from_args(parser.parse_args(argv))


def test_runner_and_pooler_config_reach_the_settings():
    settings = to_settings(_options(["--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}']))
    assert settings.runner == "pooling" and settings.pooler_config == PoolerConfig("MEAN", True)
    defaults = to_settings(_options([]))
    assert defaults.runner == "generate" and defaults.pooler_config == PoolerConfig("LAST", True)
    assert _options(["--runner", "pooling"]).to_argv(["runner", "pooler_config"]) == ["--runner", "pooling"]


@pytest.mark.parametrize("argv, error", [
    (["--pooler-config", '{"pooling_type": "MEAN"}'], "applies to --runner pooling"),
    (["--runner", "pooling", "--pooler-config", '{"pooling_type": "MAX"}'], "pooling_type"),
    (["--runner", "pooling", "--pooler-config", "{not json"], "not JSON"),
    (["--runner", "pooling", "--enable-lora"], "--enable-lora applies to --runner generate"),
])
def test_unusable_combinations_are_refused_in_one_line(argv, error):
    with pytest.raises(ValueError, match=error):
        to_settings(_options(argv))


def test_unknown_runner_is_an_argparse_error():
    with pytest.raises(SystemExit):
        _options(["--runner", "embed"])


def test_queued_embedding_becomes_a_pooling_request():
    queued = queue_pb2.QueuedRequest(request_id="e1", prompt_token_ids=[5, 6],
                                     sampling=common_pb2.SamplingParams(max_tokens=1),
                                     embedding=common_pb2.EmbeddingParams(dimensions=16, normalize=True))
    assert to_engine_request(queued).pooling == PoolingParams(dimensions=16, normalize=True)
    queued.ClearField("embedding")
    queued.embedding.SetInParent()  # every field at its default: still an embeddings request
    assert to_engine_request(queued).pooling == PoolingParams(dimensions=0, normalize=False)
    queued.ClearField("embedding")
    assert to_engine_request(queued).pooling is None  # a generation request


def test_up_hands_the_runner_to_its_worker_and_demo_does_not_take_it(tmp_path):
    from inflight.cli import _stack_settings, build_parser

    args = build_parser().parse_args(["up", "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}'])
    worker_args = _stack_settings(args, tmp_path).worker_args
    assert worker_args[worker_args.index("--runner") + 1] == "pooling"
    assert worker_args[worker_args.index("--pooler-config") + 1] == '{"pooling_type": "MEAN"}'
    with pytest.raises(SystemExit):  # demo sends chat prompts: it needs a generating worker
        build_parser().parse_args(["demo", "--runner", "pooling"])
    with pytest.raises(ValueError, match="applies to --runner pooling"):  # one line before anything starts
        _stack_settings(build_parser().parse_args(["up", "--pooler-config", "{}"]), tmp_path)
