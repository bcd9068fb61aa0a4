"""``--deterministic`` (issue 24 item 5): the start-up check and the property it promises.

Where :func:`batch_invariance_problems` finds nothing, a greedy request's tokens and
logprobs must be bit-identical whether it runs alone, beside other requests of other
lengths, with its prompt's full blocks from the prefix cache, or with another thread
count; its tokens also with speculative decoding on. Where the check finds a problem,
the worker refuses to start (tested through ``build_engine``)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import inflight_kernels
from tests.worker.fakes import fake_tokenizer
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.engine_config import EngineConfig, SpeculativeConfig
from worker.engine.sampling_params import SamplingParams
from worker.model.determinism import batch_invariance_problems, require_batch_invariance
from worker.model.model_runner import tiny_random_runner

VOCAB = fake_tokenizer().vocab_size
TARGET = [5, 17, 3, 99, 42, 7, 7, 8, 250, 11, 13, 300, 2, 31, 77, 90, 5, 17, 3, 99, 42, 6, 120, 64, 33, 1, 45]
OTHERS = [[(i * 37 + j * 11) % VOCAB for j in range(n)] for i, n in enumerate((3, 40, 9, 70, 18))]


def _runner(dtype: torch.dtype):
    # SmolLM2-135M's widths (hidden 576, 9 heads of 64 over 3 KV heads, MLP 1536), 2 layers: the
    # shapes where oneDNN's one-row kernel once summed in another order.
    return tiny_random_runner(seed=3, vocab_size=VOCAB, hidden_size=576, num_layers=2, num_heads=9,
                              num_kv_heads=3, intermediate_size=1536, dtype=dtype, num_blocks=64)


def _run(runner, batches: list[list[list[int]]], spec: SpeculativeConfig | None = None, top: int = 5):
    """Run each batch of prompts to completion on one engine; returns, for the TARGET
    prompt of each batch, (token ids, [(logprob, top logprobs) per token])."""
    config = dataclasses.replace(EngineConfig(), num_blocks=runner.num_blocks, speculative=spec)
    engine = LLMEngine(runner, fake_tokenizer(), config)
    found = []
    for b, prompts in enumerate(batches):
        params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=top, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            assert engine.add_request(EngineRequest(f"{b}-{i}", prompt, params, arrival_time=0.0)).ok
        tokens, logprobs = [], []
        target = f"{b}-{prompts.index(TARGET)}"
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == target:
                    tokens += out.token_ids
                    logprobs += [(lp.logprob, lp.top) for lp in out.logprobs or []]
        found.append((tokens, logprobs))
    return found, engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_greedy_tokens_and_logprobs_do_not_depend_on_the_batch(dtype):
    runner = _runner(dtype)
    problems = batch_invariance_problems(runner)
    if problems:
        pytest.skip("--deterministic would refuse to start here: " + "; ".join(problems))
    (alone,), _ = _run(runner, [[TARGET]])
    (batched, cached), engine = _run(runner, [[OTHERS[0], TARGET, *OTHERS[1:]], [*OTHERS[2:], TARGET]])
    assert engine.stats().prefix_cache_hit_ratio > 0  # the second batch read TARGET's blocks from the cache
    # Requests with logprobs are not speculated: compare the tokens of one without.
    (speculated,), spec_engine = _run(runner, [[TARGET, OTHERS[0]]], SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=0),
                                      top=0)
    assert spec_engine.stats().spec_num_draft_tokens > 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (one_thread,), _ = _run(runner, [[OTHERS[3], TARGET]])
    finally:
        torch.set_num_threads(threads)
    assert len(alone[0]) == 12 and len(alone[1]) == 12
    assert speculated[0] == alone[0], "speculative: other tokens"
    for name, got in (("batched", batched), ("prefix-cached", cached), ("one thread", one_thread)):
        assert got[0] == alone[0], f"{name}: other tokens"
        assert got[1] == alone[1], f"{name}: other logprob bits"


def test_plain_linear_and_missing_kernels_are_refused(monkeypatch):
    runner = tiny_random_runner(seed=1, hidden_size=128, num_heads=2, num_kv_heads=1, dtype=torch.float16)
    problems = batch_invariance_problems(runner)
    assert any("not prepacked" in p for p in problems), problems
    monkeypatch.setattr(inflight_kernels, "cpu_kernels_available", lambda: False)
    runner = tiny_random_runner(seed=1, hidden_size=128, num_heads=2, num_kv_heads=1)
    problems = batch_invariance_problems(runner)
    assert any("compiled CPU kernels are not loaded" in p for p in problems), problems
    with pytest.raises(ValueError, match="--deterministic cannot be honoured"):
        require_batch_invariance(runner)


@pytest.mark.skipif(not (inflight_kernels.cpu_dequant_bf16() and inflight_kernels.cpu_bf16_gemm()),
                    reason="no AVX-512 BF16 build on this CPU")
def test_dense_weight_copies_are_refused():
    formats = {f"model.layers.{i}.{part}.weight": "q4_1" for i in range(2)
               for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    kw = dict(seed=1, hidden_size=128, num_heads=2, num_kv_heads=1, quantization="gguf", formats=formats,
              bf16_activations=True)
    assert batch_invariance_problems(tiny_random_runner(**kw)) == []
    problems = batch_invariance_problems(tiny_random_runner(**kw, dense_min_rows=16))
    assert len(problems) == 1 and "--dense-weights-min-rows 16" in problems[0], problems
    no_blocks = tiny_random_runner(**{**kw, "formats": {}}, dense_min_rows=16)  # every weight in another type
    assert no_blocks.model.dense_min_rows == 0  # nothing was copied, so nothing to refuse


def test_cuda_is_refused():
    model = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, packed=False)
    runner = types.SimpleNamespace(model=model, config=types.SimpleNamespace(head_dim=64),
                                   cache=types.SimpleNamespace(spec=types.SimpleNamespace(dtype=torch.bfloat16)))
    (problem,) = batch_invariance_problems(runner)
    assert "device cuda" in problem


def test_the_worker_refuses_to_start(monkeypatch):
    from common.model_files import default_model_path
    from worker.serve.main import build_engine
    from worker.serve.settings import WorkerSettings

    if not default_model_path().exists():
        pytest.skip("no default model")
    monkeypatch.setattr(inflight_kernels, "cpu_kernels_available", lambda: False)
    settings = WorkerSettings(dtype="float32", deterministic=True, engine=EngineConfig(num_blocks=16))
    with pytest.raises(ValueError, match="compiled CPU kernels are not loaded"):
        build_engine(settings)
