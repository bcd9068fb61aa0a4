"""A model's own chat template from its tokenizer_config.json, checked at startup:
Gemma 2's published template (bos_token, no system role, ``model`` turns) renders
as transformers renders it; a broken or content-dropping template is one clear
line at startup (``inflight gateway``/``up``); a model without a template is told."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from common.chat_template import check_chat_template
from common.tokenizer import load_tokenizer

# google/gemma-2-2b-it tokenizer_config.json "chat_template", verbatim.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def _folder(path, template):
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<start_of_turn>": 3, "<end_of_turn>": 4, "[UNK]": 5}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1}))
    return path


def test_gemma2_template_renders_as_published(tmp_path):
    tokenizer = load_tokenizer(_folder(tmp_path, GEMMA2_TEMPLATE))
    assert check_chat_template(tokenizer) is None
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                          {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ValueError, match="System role not supported"):  # per request: a 400, not a startup error
        tokenizer.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("template,why", [
    ("{% for m in messages %}{{ m['content'] }}", "unusable: .*for"),  # never closed
    ("{{ raise_exception('no') }}", "unusable: no"),
    ("{{ messages[0]['content'] | nosuchfilter }}", "unusable"),
    ("{% for m in messages %}{{ m['role'] }}{% endfor %}", "drops the message content"),
])
def test_a_bad_template_is_one_line_naming_the_model(tmp_path, template, why):
    tokenizer = load_tokenizer(_folder(tmp_path, template))
    with pytest.raises(ValueError, match=why) as info:
        check_chat_template(tokenizer)
    assert "\n" not in str(info.value) and tmp_path.name in str(info.value)


def test_a_model_without_template_is_told_at_startup(tmp_path):
    notice = check_chat_template(load_tokenizer(_folder(tmp_path, None)))
    assert notice and "has no chat template" in notice and "completions work" in notice


def test_inflight_gateway_refuses_a_broken_template_before_it_starts(tmp_path, capsys, monkeypatch):
    import gateway.main

    from inflight.cli import main

    monkeypatch.setattr(gateway.main, "run", lambda settings: pytest.fail("the gateway must not start"))
    _folder(tmp_path, "{% if %}")
    assert main(["gateway", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inflight gateway: model ") and "chat template unusable" in err and err.count("\n") == 1
