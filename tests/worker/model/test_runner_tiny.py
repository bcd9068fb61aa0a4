"""Paged execution (chunked prefill + decodes, batched, scattered blocks) of
the tiny random model equals a plain full-sequence forward of transformers'
Llama/Qwen2 with the same weights."""

from __future__ import annotations

import pytest
import torch

from worker.runner_io import ModelInput, ScheduledChunk
from worker.model.random_weights import random_llama_weights
from worker.model.model_runner import build_step, tiny_random_runner

transformers = pytest.importorskip("transformers")


def _hf_model(config, weights):
    cls, cfg_cls = ((transformers.Qwen2ForCausalLM, transformers.Qwen2Config) if config.attention_bias
                    else (transformers.LlamaForCausalLM, transformers.LlamaConfig))
    hf_config = cfg_cls(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=config.context_length, tie_word_embeddings=False,
    )
    model = cls(hf_config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def _full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("attention_bias", [False, True], ids=["llama", "qwen2"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_chunked_run_equals_full_forward(attention_bias, block_size):
    runner = tiny_random_runner(seed=3, attention_bias=attention_bias, block_size=block_size, num_blocks=32)
    hf = _hf_model(runner.config, random_llama_weights(runner.config, seed=3))
    gen = torch.Generator().manual_seed(1)
    seq_a = torch.randint(0, 256, (40,), generator=gen).tolist()
    seq_b = torch.randint(0, 256, (23,), generator=gen).tolist()
    tables = {1: [30, 4, 17, 9, 22], 2: [11, 2, 27]}
    full = {1: _full_logits(hf, seq_a), 2: _full_logits(hf, seq_b)}
    seqs = {1: seq_a, 2: seq_b}

    def chunk(sid, start, end, needs=True):
        return ScheduledChunk(sid, seqs[sid][start:end], start, tables[sid], needs)

    steps = [
        ModelInput(prefills=[chunk(1, 0, 13), chunk(2, 0, 20, needs=False)]),
        ModelInput(prefills=[chunk(1, 13, 30), chunk(2, 20, 21)]),
        ModelInput(prefills=[chunk(1, 30, 37)], decodes=[chunk(2, 21, 22)]),
        ModelInput(decodes=[chunk(1, 37, 38), chunk(2, 22, 23)]),
        ModelInput(decodes=[chunk(1, 38, 39)]),
        ModelInput(decodes=[chunk(1, 39, 40)]),
    ]
    for step in steps:
        out = runner.execute(step)
        rows = [c for c in step.chunks if c.needs_logits]
        assert out.seq_ids == [c.seq_id for c in rows]
        assert out.logits.dtype == torch.float32 and out.logits.shape == (len(rows), 256)
        for row, c in zip(out.logits, rows):
            torch.testing.assert_close(row, full[c.seq_id][c.start_pos + len(c.token_ids) - 1], rtol=1e-4, atol=1e-4)


def test_prefix_reuse_and_warmup_leave_cache_consistent():
    runner = tiny_random_runner(seed=5, num_blocks=16)
    hf = _hf_model(runner.config, random_llama_weights(runner.config, seed=5))
    ids = list(range(1, 30))
    runner.execute(ModelInput(prefills=[ScheduledChunk(1, ids[:16], 0, [0, 1])]))
    runner.warmup(100)  # scribbles over blocks 0..6, then restores them
    # a second sequence shares the cached first block (prefix cache hit) and computes the rest
    out = runner.execute(ModelInput(prefills=[ScheduledChunk(2, ids[16:], 16, [0, 5])]))
    torch.testing.assert_close(out.logits[0], _full_logits(hf, ids)[-1], rtol=1e-4, atol=1e-4)


def test_build_step_tensors():
    chunks = [ScheduledChunk(1, [5, 6, 7], 2, [3, 8]), ScheduledChunk(2, [9], 17, [4, 1], needs_logits=True)]
    step = build_step(chunks, num_prefills=1, block_size=16, device=torch.device("cpu"))
    assert step.positions.tolist() == [2, 3, 4, 17]
    assert step.meta.slot_mapping.tolist() == [50, 51, 52, 17]
    assert step.logits_indices.tolist() == [2, 3]
    assert step.meta.decode_context_lens.tolist() == [18]
    assert step.meta.decode_block_tables.dtype == torch.int32


@pytest.mark.parametrize("bad", [
    ScheduledChunk(1, [1, 2], 0, [0]),  # decode with two tokens
    ScheduledChunk(1, [1], 16, [0]),  # block table too short
])
def test_malformed_decode_raises(bad):
    with pytest.raises(ValueError, match="sequence 1"):
        tiny_random_runner().execute(ModelInput(decodes=[bad]))


def test_bfloat16_runner_tracks_float32():
    ids = list(range(7, 40))
    step = ModelInput(prefills=[ScheduledChunk(0, ids, 0, [3, 1, 4])])
    full = tiny_random_runner(seed=2).execute(step).logits
    half = tiny_random_runner(seed=2, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    logits = half.execute(step).logits
    assert logits.dtype == torch.float32
    assert torch.corrcoef(torch.stack([logits[0], full[0]]))[0, 1] > 0.99


@pytest.mark.parametrize("num_tokens", [0, 1024, 5000])
def test_warmup_rejects_impossible_lengths(num_tokens):
    with pytest.raises(ValueError, match=f"num_tokens={num_tokens}"):
        tiny_random_runner(num_blocks=64).warmup(num_tokens)


def test_kernel_arguments_are_contiguous(monkeypatch):
    """The CUDA kernels (inflight_kernels.cuda.ops) require contiguous tensors; check the
    torch path of the decoder (the one CUDA takes; the CPU's fused path hands
    strided views to inflight_kernels.cpu.ops, which accepts them) honours that.

    The checks wrap the torch reference ops themselves (where the dispatch lands with
    the compiled CPU kernels off), and count their calls: every layer's cache write and
    decode attention must have gone through them, or the test checked nothing."""
    from collections import Counter

    from inflight_kernels import reference
    from inflight_kernels.cpu import ops as cpu_ops

    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    calls: Counter[str] = Counter()

    def checked(fn):
        def wrapper(*args, **kwargs):
            calls[fn.__name__] += 1
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            assert all(t.is_contiguous() for t in tensors), [tuple(t.stride()) for t in tensors]
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(reference, "reshape_and_cache", checked(reference.reshape_and_cache))
    monkeypatch.setattr(reference, "paged_attention", checked(reference.paged_attention))
    runner = tiny_random_runner()
    runner.execute(ModelInput(prefills=[ScheduledChunk(0, [1, 2, 3], 0, [0])],
                              decodes=[ScheduledChunk(1, [4], 5, [1]), ScheduledChunk(2, [5], 0, [2])]))
    layers = runner.config.num_layers
    assert calls["reshape_and_cache"] >= layers and calls["paged_attention"] >= layers, calls
