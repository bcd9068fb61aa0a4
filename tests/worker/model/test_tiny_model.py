"""The tiny random Llama (issue 44's second model): the gateway's half (common/tiny_model.py,
JSON only, no torch) and the worker's whole folder (worker/model/tiny_model.py) agree byte for
byte, as compose's gateway and worker-tiny images each write their own copy; the folder is a
transformers ``LlamaForCausalLM``."""

from __future__ import annotations

import pytest

from common.tiny_model import VOCAB_SIZE, write_tiny_model_files
from common.tokenizer import load_tokenizer
from common.tokenizer_fingerprint import tokenizer_fingerprint
from worker.model.tiny_model import write_tiny_model

JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def test_gateway_files_equal_the_workers_and_weights_load_in_transformers(tmp_path):
    whole = write_tiny_model(tmp_path / "worker")
    write_tiny_model_files(tmp_path / "gateway")
    for name in JSON_FILES:
        assert (whole / name).read_bytes() == (tmp_path / "gateway" / name).read_bytes(), name
    assert not (tmp_path / "gateway" / "model.safetensors").exists()
    assert (whole / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by the image's user
    tok = load_tokenizer(whole)
    assert tok.vocab_size == VOCAB_SIZE
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(load_tokenizer(tmp_path / "gateway"))

    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(whole)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model(torch.tensor([tok.encode("Hello")])).logits.shape[-1] == VOCAB_SIZE
