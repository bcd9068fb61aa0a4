"""The worker's LoRA flags (vLLM's names) from the command line to the settings, their one-line
refusals before anything loads, and a queued request's adapter reaching the engine."""

from __future__ import annotations

import argparse
import json

import pytest

from common.worker_options import WorkerOptions, add_worker_options
from protos import queue_pb2
from worker.serve.options import to_settings
from worker.serve.request_codec import to_engine_request


def _options(argv: list[str]) -> WorkerOptions:
    parser = argparse.ArgumentParser()
    add_worker_options(parser)
    return WorkerOptions.from_args(parser.parse_args(argv))


def _adapter(folder, rank: int = 8) -> str:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


def test_flags_reach_the_settings_repeatable_and_in_one_list(tmp_path):
    sql, chat = _adapter(tmp_path / "sql"), _adapter(tmp_path / "chat")
    options = _options(["--enable-lora", "--lora-modules", f"sql={sql}", "--lora-modules", f"chat={chat}",
                        "--max-loras", "4", "--max-lora-rank", "32"])
    settings = to_settings(options)
    assert settings.lora_modules == (("sql", sql), ("chat", chat))
    assert settings.engine.enable_lora and settings.engine.max_loras == 4 and settings.max_lora_rank == 32
    assert _options(["--enable-lora", "--lora-modules", f"sql={sql}", f"chat={chat}"]).lora_modules == \
        [f"sql={sql}", f"chat={chat}"]  # vLLM's form: several after one flag
    defaults = to_settings(_options([]))
    assert not defaults.engine.enable_lora and defaults.engine.max_loras == 1 and defaults.max_lora_rank == 16


@pytest.mark.parametrize("argv, why", [
    (["--lora-modules", "sql={sql}"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "sql={sql}", "sql={sql}"], "names an adapter twice: ['sql']"),
    (["--enable-lora", "--lora-modules", "sql={missing}"], "has no adapter_config.json"),
    (["--enable-lora", "--max-lora-rank", "4", "--lora-modules", "sql={sql}"], "rank 8 exceeds --max-lora-rank 4"),
])
def test_bad_lora_flags_are_refused_in_one_line(tmp_path, argv, why):
    sql = _adapter(tmp_path / "sql")
    argv = [a.format(sql=sql, missing=tmp_path / "missing") for a in argv]
    with pytest.raises(ValueError) as info:
        to_settings(_options(argv))
    assert why in str(info.value)


def test_an_adapter_of_another_base_model_is_refused_before_the_model_loads(tmp_path):
    """The default model's GGUF names itself SmolLM2 135M: an adapter trained on Llama-3.2-1B
    fails the start in one line; one trained on SmolLM2-135M (base or Instruct) passes, and so
    does one served under an alias of the operator's choosing."""
    def adapter(folder, base):
        path = _adapter(folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base}))
        return path

    llama = adapter(tmp_path / "llama", "meta-llama/Llama-3.2-1B-Instruct")
    smol = adapter(tmp_path / "smol", "HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ValueError) as info:
        to_settings(_options(["--enable-lora", "--lora-modules", f"sql={llama}"]))
    message = str(info.value)
    assert message.startswith(f"--lora-modules sql={llama}: trained on 'meta-llama/Llama-3.2-1B-Instruct'")
    assert "base model mismatch" in message and "\n" not in message
    settings = to_settings(_options(["--enable-lora", "--served-model-name", "prod", "--lora-modules", f"sql={smol}"]))
    assert settings.lora_modules == (("sql", smol),)


def test_a_malformed_lora_module_is_an_argparse_error():
    with pytest.raises(SystemExit):
        _options(["--enable-lora", "--lora-modules", "no-equals-sign"])


def test_a_queued_requests_adapter_reaches_the_engine_request():
    queued = queue_pb2.QueuedRequest(request_id="r", prompt_token_ids=[1, 2], lora_name="sql")
    assert to_engine_request(queued).lora_name == "sql"
    assert to_engine_request(queue_pb2.QueuedRequest(request_id="b", prompt_token_ids=[1])).lora_name == ""


def test_inflight_up_passes_the_lora_flags_on_and_checks_them_first(tmp_path):
    from inflight.cli import UP_WORKER_OPTIONS
    from worker.serve.options import check_stack_options

    sql = _adapter(tmp_path / "sql")
    options = _options(["--enable-lora", "--lora-modules", f"sql={sql}", "--max-loras", "2"])
    argv = options.to_argv(UP_WORKER_OPTIONS)
    assert argv[argv.index("--enable-lora"):] == ["--enable-lora", "--lora-modules", f"sql={sql}", "--max-loras", "2",
                                                  "--max-lora-rank", "16"]
    check_stack_options(options)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        check_stack_options(_options(["--lora-modules", f"sql={sql}"]))
