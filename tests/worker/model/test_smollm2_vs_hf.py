"""Acceptance: greedy tokens of our runner on the real SmolLM2 GGUF (float32)
equal Hugging Face transformers' ``generate`` on the same GGUF, alone and batched
(both sequences in the same steps, with chunked prefill mixed with decodes), with
a float32 KV cache and with the default ("auto": float16 on a CPU with the
compiled attention kernel, :func:`worker.model.dtype.resolve_kv_cache_dtype`)."""

from __future__ import annotations

import pytest
import torch

from common.model_files import default_model_path
from common.tokenizer import load_tokenizer
from worker.runner_io import ModelInput, ScheduledChunk
from worker.model.model_runner import load_model_runner

transformers = pytest.importorskip("transformers")
NEW_TOKENS = 32
PROMPTS = [
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "system", "content": "You are a patient teacher."},
     {"role": "user", "content": "Explain in detail how a bicycle's gears work, step by step."}],
]


def _load_hf(path):
    """transformers' own GGUF loading. ``from_pretrained(gguf_file=...)`` needs
    ``accelerate``; without it, build from the GGUF config and load transformers'
    own dequantized GGUF checkpoint (same conversion code)."""
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except ValueError as exc:
        if "accelerate" not in str(exc):
            raise
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer(default_model_path())
    return [tokenizer.encode(tokenizer.apply_chat_template(m)) for m in PROMPTS]


@pytest.fixture(scope="module")
def hf_tokens(prompts):
    model = _load_hf(default_model_path()).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=NEW_TOKENS, do_sample=False)
            outputs.append(generated[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module", params=["float32", "auto"], ids=lambda kv: f"kv-{kv}")
def runner(request):
    return load_model_runner(default_model_path(), dtype="float32", num_blocks=64, kv_cache_dtype=request.param)


def greedy(runner, prompts: list[list[int]], new_tokens: int, chunk: int) -> list[list[int]]:
    """Minimal engine: prefill in ``chunk``-token pieces, then decode all together."""
    per_seq = 2 * (-(-(max(map(len, prompts)) + new_tokens) // runner.block_size))
    tables = [list(range(runner.num_blocks - 1 - i, -1, -len(prompts)))[: per_seq] for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    while any(len(t) - len(p) < new_tokens for t, p in zip(tokens, prompts)):
        prefills, decodes = [], []
        for i, p in enumerate(prompts):
            if len(tokens[i]) - len(p) >= new_tokens:
                continue
            if cached[i] < len(p):
                end = min(cached[i] + chunk, len(p))
                prefills.append(ScheduledChunk(i, tokens[i][cached[i]:end], cached[i], tables[i], end == len(p)))
            else:
                decodes.append(ScheduledChunk(i, tokens[i][-1:], len(tokens[i]) - 1, tables[i]))
        out = runner.execute(ModelInput(prefills=prefills, decodes=decodes))
        for c in prefills + decodes:
            cached[c.seq_id] = c.start_pos + len(c.token_ids)
        for seq_id, row in zip(out.seq_ids, out.logits):
            tokens[seq_id].append(int(row.argmax()))
    return [t[len(p):] for t, p in zip(tokens, prompts)]


def _assert_same(ours: list[int], theirs: list[int]) -> None:
    # HF stops at EOS (id 2); compare up to and including it.
    assert len(theirs) >= 8, theirs
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("index", [0, 1])
def test_alone_matches_hf_generate(runner, prompts, hf_tokens, index):
    (ours,) = greedy(runner, [prompts[index]], NEW_TOKENS, chunk=1 << 16)
    _assert_same(ours, hf_tokens[index])


def test_batched_with_chunked_prefill_matches_hf_generate(runner, prompts, hf_tokens):
    ours = greedy(runner, prompts, NEW_TOKENS, chunk=16)
    for mine, theirs in zip(ours, hf_tokens):
        _assert_same(mine, theirs)
