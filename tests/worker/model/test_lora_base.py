"""An adapter's base model against the worker's model (worker/model/lora_base.py): refused only
when both are known and clearly differ; loaded (and logged) when either side names nothing."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from worker.model.lora_base import ModelIdentity, adapter_base, check_base_model, model_identity, name_tokens

SMOLLM2 = ModelIdentity(names=("Smollm2 135M 8k Lc100K Mix1 Ep2", "smollm2 135M"),
                        labels=("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def _check(base, identity=SMOLLM2) -> None:
    check_base_model({"base_model_name_or_path": base}, identity, "LoRA adapter 'a' (/p)")


@pytest.mark.parametrize("name, words", [
    ("meta-llama/Llama-3.2-1B-Instruct", {"llama", "3.2", "1b"}),
    ("Llama3-8B", {"llama", "3", "8b"}),  # letters meeting digits split: Llama3 = Llama-3
    ("mistralai/Mistral-7B-Instruct-v0.3", {"mistral", "7b", "0.3"}),
    ("unsloth/llama-3-8b-Instruct-bnb-4bit", {"llama", "3", "8b"}),  # quantized training copies
    ("tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf", {"tinyllama", "1.1b", "1.0"}),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", {"smollm", "2", "135m"}),
    ("google/gemma-2-2b-it", {"gemma", "2", "2b"}),
    ("hf", set()),
])
def test_names_reduce_to_the_words_that_identify_the_model(name, words):
    assert name_tokens(name) == words


@pytest.mark.parametrize("base", ["HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M",
                                  "SmolLM2-135M", "smollm2", "/home/me/.cache/huggingface/hub/"
                                  "models--HuggingFaceTB--SmolLM2-135M/snapshots/0123abcd"])
def test_the_same_model_or_its_base_or_instruct_variant_loads(base):
    _check(base)


@pytest.mark.parametrize("base", ["meta-llama/Llama-3.2-1B-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct",
                                  "Qwen/Qwen2.5-0.5B"])
def test_a_clearly_different_base_is_refused_naming_both(base):
    with pytest.raises(ValueError) as info:
        _check(base)
    message = str(info.value)
    assert message.startswith("LoRA adapter 'a' (/p): trained on ") and base in message
    assert "Smollm2 135M" in message and "base model mismatch" in message and "\n" not in message


def test_mistral_versions_differ_but_instruct_and_base_do_not():
    mistral = ModelIdentity(names=("Mistral 7B Instruct v0.3",))
    _check("mistralai/Mistral-7B-v0.3", mistral)
    with pytest.raises(ValueError, match="base model mismatch"):
        _check("mistralai/Mistral-7B-v0.1", mistral)


@pytest.mark.parametrize("base", [None, "", "/data/ckpt/step-500", "./base", "C:\\models\\llama"])
def test_no_base_or_a_local_path_loads_and_says_so(base, caplog):
    with caplog.at_level(logging.INFO, logger="worker.model.lora_base"):
        _check(base)
    assert "loaded without comparing" in caplog.text


def test_a_model_that_names_nothing_never_refuses(caplog):
    operator_only = ModelIdentity(names=("hf",), labels=("prod", "model.gguf"))  # served names say nothing
    assert not operator_only.known
    with caplog.at_level(logging.INFO, logger="worker.model.lora_base"):
        _check("meta-llama/Llama-3.2-1B", operator_only)
        _check("meta-llama/Llama-3.2-1B", None)
    assert "names itself nothing to compare" in caplog.text


def test_operator_labels_confirm_a_match():
    """A GGUF whose metadata names another model (a finetune's parent, a converter's folder
    name) still takes an adapter trained on the name it is served as."""
    identity = ModelIdentity(names=("Qwen2.5 0.5B",), labels=("my-sql-bot-0.5b",))
    _check("acme/my-sql-bot-0.5b", identity)
    with pytest.raises(ValueError):
        _check("acme/other-bot-0.5b", identity)


def test_adapter_base_forms():
    assert adapter_base("org/name") == ("org/name", "")
    assert adapter_base("gpt2") == ("gpt2", "")
    assert adapter_base("/x/models--org--name/snapshots/abc")[0] == "org/name"
    assert adapter_base("/abs/path")[0] is None and adapter_base(7)[0] is None


def test_identity_of_a_gguf_file_reads_its_general_names(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "renamed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Llama 3.2 1B Instruct")
    writer.add_basename("Llama-3.2")
    writer.add_size_label("1B")
    writer.add_base_model_count(1)
    writer.add_base_model_name(0, "Llama 3.2 1B")
    writer.add_base_model_repo_url(0, "https://huggingface.co/meta-llama/Llama-3.2-1B")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    identity = model_identity(path, ("chat",))
    assert identity.names == ("Llama 3.2 1B Instruct", "Llama-3.2 1B", "Llama 3.2 1B", "meta-llama/Llama-3.2-1B")
    assert identity.labels == ("chat", "renamed.gguf") and identity.known
    _check("meta-llama/Llama-3.2-1B", identity)
    with pytest.raises(ValueError):
        _check("meta-llama/Llama-3.2-3B", identity)


def test_identity_of_an_hf_folder_and_of_nothing_readable(tmp_path):
    hub = tmp_path / "models--acme--Tiny-7B" / "snapshots" / "abc"
    hub.mkdir(parents=True)
    (hub / "config.json").write_text(json.dumps({"_name_or_path": "acme/Tiny-7B"}))
    assert model_identity(hub) == ModelIdentity(names=("acme/Tiny-7B",), labels=("acme/Tiny-7B",))
    local = tmp_path / "out"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"_name_or_path": "/tmp/run3/final"}))
    assert not model_identity(local, ("served",)).known  # a local path says nothing decisive
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    assert model_identity(broken, ("x",)) == ModelIdentity((), ("x", "broken.gguf"))
    assert model_identity(None, ("x",)) == ModelIdentity((), ("x",))


def test_the_runner_refuses_a_fitting_adapter_of_another_base(tmp_path):
    """Shapes that fit the tiny runner, a base that names another model: refused by name once
    the runner knows its model's; loaded while it does not (a runner built outside a worker)."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    from worker.model.model_runner import tiny_random_runner

    runner = tiny_random_runner(vocab_size=64, num_blocks=4)
    folder = tmp_path / "a"
    folder.mkdir()
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
         "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}))
    runner.add_lora(1, "a", str(folder))  # nothing known of the model: loaded
    runner.model_identity = ModelIdentity(names=("tiny-random-llama",))
    with pytest.raises(ValueError, match="trained on 'meta-llama/Llama-3.2-1B'.*base model mismatch"):
        runner.add_lora(2, "a", str(folder))
    assert list(runner.loras) == [1]
