"""A decode step's layers in one C++ call (``inflight_kernels.decode_stack``: q8_0 weights,
or bfloat16 ones packed for our bf16 GEMM) give bit-identical logits and KV caches
to the Python fused path it replaces, over prefills, batched decodes with uneven
contexts, GQA, q/k/v biases, a sliding window and each CPU cache dtype."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from unittest import mock

import pytest
import torch

import inflight_kernels
from worker.runner_io import ModelInput, ScheduledChunk
from worker.model.linear import uses_bf16_kernel
from worker.model.model_runner import tiny_random_runner

pytestmark = pytest.mark.skipif(not inflight_kernels.cpu_fast_attention(64), reason="compiled CPU kernels not available")

LAYERS = 3


def _gguf_formats(layer_kind) -> dict[str, str]:
    """GGUF types for ``--quantization gguf``: layer i's projections ``layer_kind(i)``, a Q8_0 lm_head."""
    formats = {"model.embed_tokens.weight": "q8_0", "lm_head.weight": "q8_0"}
    for i in range(LAYERS):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            formats[f"model.layers.{i}.{part}.weight"] = layer_kind(i)
    return formats


GGUF = {"gguf-q4": _gguf_formats(lambda i: "q4_1"),  # the default model's layout
        "gguf-mixed": _gguf_formats(lambda i: "q8_0" if i == 1 else "q4_1")}
GGUF["gguf-q4-bf16"] = GGUF["gguf-mixed-bf16"] = None  # the same, Q4_1 products with bfloat16 activations
DENSE_MIN_ROWS = 8  # "-dense": the prefills and the steps with chunks (10-42 rows) take the dense copies, 3 decodes not


def _runner(kv_dtype: torch.dtype, bias: bool, window: int, weights: str):
    dtype, quantization = (torch.float32, weights) if weights in ("q8_0", "q4_1") else (torch.bfloat16, "none")
    onednn = weights.endswith("-onednn")  # the dense copies packed for oneDNN, as on an AMX CPU
    weights = weights.removesuffix("-onednn")
    if weights.removesuffix("-dense") in GGUF:
        dtype, quantization = torch.float32, "gguf"
    dense = weights.endswith("-dense")
    weights = weights.removesuffix("-dense")
    bf16_activations = weights.endswith("-bf16")
    with mock.patch("worker.model.dtype.cpu_has_amx", return_value=onednn) if dense else nullcontext():
        runner = tiny_random_runner(seed=5, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256,
                                    num_layers=LAYERS, num_blocks=64, attention_bias=bias, dtype=dtype,
                                    kv_cache_dtype=kv_dtype, quantization=quantization,
                                    formats=GGUF.get(weights.removesuffix("-bf16")),
                                    bf16_activations=bf16_activations, dense_min_rows=DENSE_MIN_ROWS if dense else 0)
    if window:  # Mistral-style windows on every layer but the last
        runner.model.config = replace(runner.model.config, layer_windows=(window,) * (LAYERS - 1) + (0,))
    return runner


LATE = (4, list(range(40, 77)), [20, 21, 22, 23])  # a prompt prefilled in two chunks beside the decodes


def _run(runner, prompts: dict[int, list[int]], tables: dict[int, list[int]], steps: int):
    """Prefill every prompt, then ``steps`` greedy decode steps of all of them together,
    with a late prompt's two prefill chunks (the second also asking for the logits of
    its last 4 rows, as a verification chunk does) riding in steps 3 and 4; returns
    each step's logits."""
    out = [runner.execute(ModelInput(prefills=[ScheduledChunk(s, ids, 0, tables[s]) for s, ids in prompts.items()]))]
    seqs = {s: list(ids) + [int(out[0].logits[i].argmax())] for i, (s, ids) in enumerate(prompts.items())}
    late_id, late, late_table = LATE
    for step_no in range(steps):
        prefills = {3: [ScheduledChunk(late_id, late[:30], 0, late_table, False)],
                    4: [ScheduledChunk(late_id, late[30:], 30, late_table, True, num_draft_tokens=3)]}.get(step_no, [])
        step = runner.execute(ModelInput(prefills=prefills, decodes=[
            ScheduledChunk(s, ids[-1:], len(ids) - 1, tables[s]) for s, ids in seqs.items()]))
        out.append(step)
        first = 4 if step_no == 4 else 0  # the verification chunk's logits rows come first
        for i, ids in enumerate(seqs.values()):
            ids.append(int(step.logits[first + i].argmax()))
    return [o.logits for o in out]


BF16 = pytest.mark.skipif(not uses_bf16_kernel(torch.bfloat16, torch.device("cpu")),
                          reason="bf16 weights are oneDNN's on this CPU (no AVX-512 BF16, or AMX)")
DEQUANT_BF16 = pytest.mark.skipif(not inflight_kernels.cpu_dequant_bf16(), reason="no AVX-512 BF16 build on this CPU")


@pytest.mark.parametrize("weights, kv_dtype, bias, window", [
    ("q8_0", torch.bfloat16, False, 0),
    ("q8_0", torch.float16, True, 0),
    ("q8_0", torch.float32, False, 20),
    ("q4_1", torch.float16, True, 0),
    ("q4_1", torch.float32, False, 20),
    ("gguf-q4", torch.float16, True, 0),
    ("gguf-mixed", torch.float32, False, 20),
    pytest.param("gguf-q4-bf16", torch.float16, True, 0, marks=DEQUANT_BF16),
    pytest.param("gguf-mixed-bf16", torch.float32, False, 20, marks=DEQUANT_BF16),
    pytest.param("gguf-mixed-bf16-dense", torch.bfloat16, True, 20, marks=DEQUANT_BF16),
    pytest.param("gguf-mixed-bf16-dense-onednn", torch.bfloat16, False, 0, marks=DEQUANT_BF16),
    pytest.param("bf16", torch.bfloat16, True, 0, marks=BF16),
    pytest.param("bf16", torch.bfloat16, False, 20, marks=BF16),
    pytest.param("bf16", torch.float32, False, 0, marks=BF16),
], ids=["q8-bf16-cache", "q8-fp16-cache-bias", "q8-fp32-cache-window", "q4-fp16-cache-bias",
        "q4-fp32-cache-window", "gguf-q4-fp16-cache-bias", "gguf-mixed-fp32-cache-window",
        "gguf-q4-bf16-activations", "gguf-mixed-bf16-activations-window", "gguf-mixed-dense-copies-bias-window",
         "gguf-mixed-onednn-dense-copies",
        "bf16-bias", "bf16-window",
        "bf16-fp32-cache"])
def test_decode_stack_equals_python_fused_path(weights, kv_dtype, bias, window):
    stacked, plain = _runner(kv_dtype, bias, window, weights), _runner(kv_dtype, bias, window, weights)
    plain.model.use_decode_stack = False
    gen = torch.Generator().manual_seed(2)
    prompts = {1: torch.randint(0, 256, (9,), generator=gen).tolist(),
               2: torch.randint(0, 256, (31,), generator=gen).tolist(),
               3: torch.randint(0, 256, (2,), generator=gen).tolist()}
    tables = {1: [40, 3, 17, 8], 2: [11, 2, 27, 5, 60], 3: [33, 7, 50]}
    got, want = _run(stacked, prompts, tables, steps=14), _run(plain, prompts, tables, steps=14)
    assert stacked.model._stack is not None and stacked.model._stack[1] is not None, "the stack did not run"
    if weights.removesuffix("-onednn").removesuffix("-dense") in GGUF:  # weight-only blocks, as the formats say
        kinds = {type(layer.o).__name__ for layer in stacked.model.layers}
        assert kinds == ({"Q4Weight"} if weights.startswith("gguf-q4") else {"Q4Weight", "Q8Weight"})
        assert stacked.model.layers[0].o.float_activations and stacked.model.lm_head.float_activations
        assert stacked.model.layers[0].o.bf16_activations == ("-bf16" in weights)
        dense = stacked.model.layers[0].o.dense
        assert (dense is not None) == ("-dense" in weights)
        assert dense is None or (dense.layout == torch._mkldnn) == weights.endswith("-onednn")
    assert plain.model._stack is None
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max()}"
    for (ka, va), (kb, vb) in zip(stacked.cache.layers, plain.cache.layers):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    if weights.endswith("-bf16"):  # the rounding took place: float32 activations give other logits
        exact = _run(_runner(kv_dtype, bias, window, weights.removesuffix("-bf16")), prompts, tables, steps=1)
        assert not torch.equal(exact[1], got[1])
    if "-dense" in weights:  # the 42-row prefill took the dense copies: the blocks alone give other logits
        blocks_only = weights.removesuffix("-onednn").removesuffix("-dense")
        blocks = _run(_runner(kv_dtype, bias, window, blocks_only), prompts, tables, steps=0)
        assert not torch.equal(blocks[0], got[0])
        tolerance = 0.15 if weights.endswith("-onednn") else 0.05  # oneDNN rounds each product to bfloat16 too
        assert torch.allclose(blocks[0], got[0], atol=tolerance, rtol=0.05), (blocks[0] - got[0]).abs().max()


def test_oneDNN_weights_keep_the_python_path():
    runner = tiny_random_runner(seed=5, hidden_size=128, num_heads=2, num_kv_heads=1, num_layers=2)  # float32
    runner.execute(ModelInput(prefills=[ScheduledChunk(1, [1, 2, 3], 0, [0])]))
    runner.execute(ModelInput(decodes=[ScheduledChunk(1, [4], 3, [0])]))
    assert runner.model._stack is None
