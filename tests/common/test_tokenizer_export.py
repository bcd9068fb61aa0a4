"""``inflight tokenizer export DIR``: transformers' AutoTokenizer loads the folder and
encodes and applies the chat template exactly as common.tokenizer does."""

from __future__ import annotations

import json

import pytest

from common.model_files import default_model_path
from common.tokenizer import load_tokenizer
from inflight.cli import main

transformers = pytest.importorskip("transformers")

PROMPTS = ["Hello world!", "What is the capital of France?", "12345 digits, 3.14159 and 1e-9",
           "你好，世界。今天天气很好 🚀🔥", "  leading spaces\n\ttabs\r\nand trailing  ",
           "a special token <|im_start|> inside text", ""]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "2+2?"}],
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    assert main(["tokenizer", "export", str(out)]) == 0
    return out


def test_the_folder_holds_what_transformers_reads(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
            "generation_config.json"} <= names
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config["chat_template"] and config["model_max_length"] == load_tokenizer(default_model_path()).context_length


def test_auto_tokenizer_encodes_and_templates_as_common_tokenizer(exported):
    ours = load_tokenizer(default_model_path())
    theirs = transformers.AutoTokenizer.from_pretrained(str(exported))
    for text in PROMPTS:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids, text
        assert theirs(text)["input_ids"] == ours.encode(text, add_special_tokens=True), text
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
    for messages in CHATS:
        for gen in (True, False):
            assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
                ours.apply_chat_template(messages, add_generation_prompt=gen)
    assert theirs.convert_tokens_to_ids(theirs.eos_token) in ours.eos_token_ids
    assert len(theirs) == ours.vocab_size


def test_common_tokenizer_loads_the_export_back_the_same(exported):
    ours, back = load_tokenizer(default_model_path()), load_tokenizer(exported)
    assert (back.eos_token_ids, back.bos_token_id, back.context_length, back.vocab_size) == \
        (ours.eos_token_ids, ours.bos_token_id, ours.context_length, ours.vocab_size)
    assert back.encode(PROMPTS[3]) == ours.encode(PROMPTS[3])
    assert back.apply_chat_template(CHATS[1]) == ours.apply_chat_template(CHATS[1])


def test_export_of_a_missing_model_fails_in_one_line(tmp_path, capsys):
    assert main(["tokenizer", "export", str(tmp_path / "out"), "--model", str(tmp_path / "none.gguf")]) == 2
    assert "inflight tokenizer export:" in capsys.readouterr().err
