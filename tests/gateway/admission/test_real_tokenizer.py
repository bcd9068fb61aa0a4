"""Validation with the real SmolLM2 tokenizer (no torch): chat template and context length."""

import pytest

from gateway.errors import InvalidRequestError
from gateway.admission.params import RequestParams
from gateway.admission.validation import RequestLimits, validate_request


@pytest.fixture(scope="module")
def tokenizer():
    try:
        from common.model_files import resolve_model_path
        from common.tokenizer import load_tokenizer
        return load_tokenizer(resolve_model_path(None))
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")


def test_chat_and_context(tokenizer):
    limits = RequestLimits(served_model="SmolLM2-135M-Instruct")
    chat = validate_request(tokenizer, limits, RequestParams(messages=[{"role": "user", "content": "hi"}]))
    assert 3 < chat.prompt_tokens < 60  # special tokens encode as single ids
    assert chat.max_tokens == 512
    with pytest.raises(InvalidRequestError, match="context length"):
        validate_request(tokenizer, limits, RequestParams(prompt="hello",
                                                           max_tokens=tokenizer.context_length))
