"""A tiny deterministic tokenizer for gateway tests: one token per character."""

from __future__ import annotations


class CharTokenizer:
    """Char-level tokenizer: token id = code point % vocab_size; context 128 tokens."""

    def __init__(self, vocab_size: int = 300, context_length: int = 128):
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.eos_token_ids = frozenset({0})
        self.model_name = "fake"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")
