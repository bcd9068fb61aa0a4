"""A tiny random model and byte tokenizer (``--model tiny``) for smoke tests of the benchmark itself."""

from __future__ import annotations

import torch


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; no EOS (so ``ignore_eos`` is moot)."""

    eos_token_ids: frozenset[int] = frozenset()
    model_name = "tiny-random"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (its UTF-8 bytes)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (invalid UTF-8 replaced)."""
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The messages' contents, one per line."""
        return "\n".join(m["content"] for m in messages)


def tiny_runner(num_blocks: int = 512, device: str | torch.device = "cpu"):
    """A 2-layer random Llama of vocab 256 on ``device`` (see ``worker.model.model_runner.tiny_random_runner``)."""
    from worker.model.model_runner import tiny_random_runner

    return tiny_random_runner(num_blocks=num_blocks, context_length=2048, device=device)


def tiny_hf_model():
    """A random transformers Llama of the same shape (for smoke tests of the HF peers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=255, pad_token_id=0)
    return LlamaForCausalLM(config).eval()
