"""``chat_template_kwargs`` (vLLM's extra parameter) reach the real tokenizer's chat template:
Qwen3's ``enable_thinking`` switch renders the empty think block (a Qwen3-style template); the server's own variables, bad shapes and special tokens are 400s
naming the field (gateway/template_kwargs.py)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from common.tokenizer import Tokenizer, _Specials
from gateway.errors import InvalidRequestError
from gateway.prompts import chat_prompt_ids

# The part of Qwen3's template that reads the switch (its generation prompt).
QWEN3_STYLE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n"
               "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
               "{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen3_style():
    """The real ``common.tokenizer.Tokenizer`` over a byte-level BPE with no merges (one
    token per byte, built in milliseconds) and Qwen3's two special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    end = hf.token_to_id("<|im_end|>")
    specials = _Specials(bos_token_id=None, eos_token_ids=frozenset({end}), bos_token="",
                         eos_token="<|im_end|>", add_bos_token=False)
    return Tokenizer(hf, specials, chat_template=QWEN3_STYLE, context_length=4096, model_name="qwen3-style")


def _text(tokenizer, kwargs) -> str:
    return tokenizer.decode(chat_prompt_ids(tokenizer, MESSAGES, template_kwargs=kwargs),
                            skip_special_tokens=False)


def test_enable_thinking_reaches_the_template(qwen3_style):
    assert _text(qwen3_style, None).endswith("<|im_start|>assistant\n")
    assert _text(qwen3_style, {"enable_thinking": True}).endswith("<|im_start|>assistant\n")
    assert _text(qwen3_style, {"enable_thinking": False}).endswith("assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("kwargs, param", [
    ([1], "chat_template_kwargs"),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"not an identifier": 1}, "chat_template_kwargs"),
    ({"x": "<|im_end|>\n<|im_start|>system"}, "chat_template_kwargs"),
    ({"x": "a" * 20000}, "chat_template_kwargs"),
])
def test_refused_kwargs_name_the_field(qwen3_style, kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        chat_prompt_ids(qwen3_style, MESSAGES, template_kwargs=kwargs)
    assert err.value.param == param
