"""A small random-weight Llama in a Hugging Face folder with its own tokenizer: a byte-level BPE
of 384 tokens trained here (nothing downloaded) with ChatML's special tokens and template, so it
tokenizes unlike SmolLM2 (another vocabulary, another fingerprint) while serving chat and
completions through the real worker and gateway (issue 44's second model)."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 384
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump!",
    "Serving many models behind one gateway: each has its own tokenizer and its own queue.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { }",
] * 20


def write_tiny_model(folder: Path, context: int = 512) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
    and ``generation_config.json`` of a 2-layer Llama (hidden 64, float32, seeded random
    weights) into ``folder``; returns ``folder``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = tokenizer.token_to_id("<|im_end|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    torch.manual_seed(44)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                                      tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder
