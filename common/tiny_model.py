"""A small random-weight Llama's files, made here with nothing downloaded (issue 44's second
model: the two-model tests, and compose's ``worker-tiny`` beside SmolLM2).

Its tokenizer is a byte-level BPE of 384 tokens trained here on a fixed corpus, with ChatML's
special tokens and template, so it tokenizes unlike SmolLM2 (another vocabulary, another
fingerprint) while serving chat and completions through the real worker and gateway. The BPE
trainer of ``tokenizers`` is deterministic for one corpus and one ``tokenizers`` version, so a
gateway and a worker that each write these files (compose's two images) hold the same
tokenizer fingerprint; a mismatch would be refused loudly (gateway/model_registry.py).

This module writes the JSON files only (``config.json``, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``): what a gateway reads, no torch. The
weights (``model.safetensors``) come from :mod:`worker.model.tiny_model`.

    python -m common.tiny_model FOLDER      # the tokenizer and config files only
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "CONTEXT", "SPECIAL", "TINY_MODEL_NAME", "VOCAB_SIZE", "tiny_config",
           "write_tiny_model_files"]

#: The id compose serves it under (its workers' ``--served-model-name``).
TINY_MODEL_NAME = "tiny-random"
VOCAB_SIZE = 384
#: Default context length in tokens (``max_position_embeddings``).
CONTEXT = 512
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


def tiny_config(vocab_size: int, eos_token_id: int, context: int = CONTEXT) -> dict:
    """The ``config.json`` of the tiny Llama (transformers' v4 layout): 2 layers, hidden 64,
    4 query heads and 2 KV heads of 16, MLP 128, float32, untied embeddings, no BOS."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": context,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": eos_token_id,
        "torch_dtype": "float32", "initializer_range": 0.02,
    }


def write_tiny_model_files(folder: Path, context: int = CONTEXT) -> dict:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``config.json`` and
    ``generation_config.json`` into ``folder`` (made if missing).

    Args:
        folder: the model folder.
        context: the context length in tokens.

    Returns:
        The ``config.json`` dict written.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    config = tiny_config(tokenizer.get_vocab_size(with_added_tokens=True), eos, context)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return config


def main(argv: list[str] | None = None) -> None:
    """``python -m common.tiny_model FOLDER [--context N]``: the JSON files only."""
    parser = argparse.ArgumentParser(description="Write the tiny random Llama's tokenizer and config files.")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--context", type=int, default=CONTEXT)
    args = parser.parse_args(argv)
    write_tiny_model_files(args.folder, args.context)


if __name__ == "__main__":
    main()
