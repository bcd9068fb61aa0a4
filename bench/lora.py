"""LoRA in the continuous batch: a decode step whose rows use several adapters against the
base model's step (issue 44 item 9; goal: at most 1.3x).

B sequences (``--batch``, 32) decode with ``--context`` tokens each, and the runner's
forward pass of their decode step is timed for each case below, the cases in turn round after
round (the minimum over ``--repeats`` rounds), so a machine busy with other work slows each alike;
the cases differ only in the adapter each row runs with (``ScheduledChunk.lora_id``, the id a
request naming the adapter gets):

- ``base``: every row the base model, the step as it runs today (on the CPU with GGUF blocks
  its layers run in one C++ call, ``inflight_kernels.decode_stack``);
- ``base, layer path``: the same rows through the layer-by-layer path, the path every step
  with LoRA rows takes (the C++ stack has no LoRA), so the LoRA product's own cost shows;
- ``N adapters``: every row one of ``--adapters`` random rank-``--rank`` adapters (all seven
  projections adapted, the rows dealt round robin);
- ``base + N adapters``: half the rows the base model, the rest dealt over the adapters;
- ``N adapters, masked``: the ``N adapters`` rows through the masked torch product (every
  adapter's columns for every row) instead of the grouped kernel
  (``inflight_kernels/cpu/lora_gemm.cpp``, CPU only), the product the others use where
  it runs.

The adapters are written in PEFT's format (random weights, every projection adapted) into a
temporary folder and loaded through ``LLMEngine.add_lora``, as ``--lora-modules`` loads them.
The ratio column is each step over ``base``. The product is :mod:`worker.model.lora_batch`.

Usage: ``python -m bench.lora [--batch 32] [--adapters 4] [--rank 16] [--context 128]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

import inflight_kernels
from bench.options import add_out_option
from bench.report import context, write_stamped_csv
from bench.targets.engine import EngineTargetSettings, dtype_label, load
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.engine_config import EngineConfig
from worker.engine.sampling_params import SamplingParams
from worker.runner_io import ModelInput

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, config, rank: int, seed: int) -> str:
    """A PEFT adapter for a model of ``config`` (:class:`worker.model.model_config.ModelConfig`):
    every projection of every layer adapted with rank ``rank``, A and B ~ N(0, 1 / fan_in),
    ``lora_alpha`` = 2 x rank; returns the folder."""
    import torch
    from safetensors.torch import save_file

    shapes = {"q_proj": (config.q_size, config.hidden_size), "k_proj": (config.kv_size, config.hidden_size),
              "v_proj": (config.kv_size, config.hidden_size), "o_proj": (config.hidden_size, config.q_size),
              "gate_proj": (config.intermediate_size, config.hidden_size),
              "up_proj": (config.intermediate_size, config.hidden_size),
              "down_proj": (config.hidden_size, config.intermediate_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in MODULES:
            out, inp = shapes[module]
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) / rank ** 0.5
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}))
    return str(folder)


def decoding_engine(runner, tokenizer, batch: int, prompt_len: int, max_loras: int) -> LLMEngine:
    """An engine for ``batch`` rows of ``prompt_len``-token prompts, LoRA on (``max_loras``)."""
    config = EngineConfig(block_size=runner.block_size, num_blocks=runner.num_blocks, max_num_seqs=batch,
                          max_num_batched_tokens=max(2048, batch * prompt_len), enable_lora=True,
                          max_loras=max_loras)
    return LLMEngine(runner, tokenizer, config)


def start(engine: LLMEngine, batch: int, prompt_len: int, max_tokens: int) -> None:
    """Add ``batch`` base-model requests and step until every row decodes."""
    for i in range(batch):
        prompt = [(7 * i + j) % 200 + 1 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        result = engine.add_request(EngineRequest(f"r{i}", prompt, params))
        assert result.ok, result.reason
    while engine.stats().num_running < batch or engine.scheduler.waiting:
        engine.step()
    engine.step()


def step_inputs(engine: LLMEngine, cases: list[tuple[str, list[str], bool]]) -> list[ModelInput]:
    """One decode step's input per case: the engine's decoding rows, row i run with adapter
    ``lora_names[i]`` ("" the base model), the adapters' runner ids as a request naming them gets."""
    base = engine.scheduler.schedule().model_input
    inputs = []
    for _, lora_names, _ in cases:
        ids = {}
        for name in set(lora_names) - {""}:
            entry = engine.loras.acquire(name)  # loaded, most recently used; the id a request gets
            engine.loras.release(entry.lora_id)
            ids[name] = entry.lora_id
        decodes = [dataclasses.replace(c, lora_id=ids.get(name, 0)) for c, name in zip(base.decodes, lora_names)]
        assert len(decodes) == len(lora_names) == len(base.decodes)
        inputs.append(dataclasses.replace(base, decodes=decodes))
    return inputs


def time_alternately(runner, inputs: list[ModelInput], stacks: list[bool], repeats: int,
                     grouped: list[bool] | None = None) -> list[float]:
    """Each input's forward pass, ms: the minimum over ``repeats`` rounds that run every input
    once in turn (so a machine busy with other work slows each alike), after one warm round.
    ``stacks[k]``: input k may use the one-call decode stack; ``grouped[k]`` (default all
    True): its LoRA rows may use the grouped product."""
    grouped = grouped or [True] * len(inputs)
    best = [float("inf")] * len(inputs)
    for round_ in range(repeats + 1):
        for k, (model_input, stack) in enumerate(zip(inputs, stacks)):
            runner.model.use_decode_stack = stack
            runner.lora_stacks.grouped = grouped[k]
            begin = time.perf_counter()
            runner.execute(model_input)
            if round_:
                best[k] = min(best[k], (time.perf_counter() - begin) * 1e3)
    runner.model.use_decode_stack = True
    runner.lora_stacks.grouped = True
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model spec (default SmolLM2-135M-Instruct; tiny: random)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", default="auto")
    add_out_option(parser)
    args = parser.parse_args(argv)
    ctx = context("python -m bench.lora " + shlex.join(argv if argv is not None else sys.argv[1:]))
    blocks = args.batch * (-(-(args.context + args.repeats + 16) // 16)) + 16
    runner, tokenizer = load(EngineTargetSettings(model=args.model, dtype=args.dtype,
                                                  kv_cache_mib=None, max_batch_size=args.batch))
    if runner.num_blocks < blocks:
        raise SystemExit(f"the KV cache holds {runner.num_blocks} blocks, the bench needs {blocks}")
    runner.max_lora_rank = max(runner.max_lora_rank, args.rank)
    names = [f"lora{i}" for i in range(args.adapters)]
    half = args.batch // 2
    mixed = [names[i % len(names)] for i in range(args.batch)]
    cases = [("base", [""] * args.batch, True), ("base, layer path", [""] * args.batch, False),
             (f"{args.adapters} adapters", mixed, True),
             (f"base + {args.adapters} adapters",
              [""] * half + [names[i % len(names)] for i in range(args.batch - half)], True),
             (f"{args.adapters} adapters, masked", mixed, True)]
    grouped = [True, True, True, True, False]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        engine = decoding_engine(runner, tokenizer, args.batch, args.context, max(1, args.adapters))
        for seed, name in enumerate(names, start=1):
            engine.add_lora(name, write_random_adapter(Path(tmp) / name, runner.config, args.rank, seed))
        start(engine, args.batch, args.context, args.repeats + 8)
        inputs = step_inputs(engine, cases)
        kernel = inflight_kernels.lora_kernel(torch.empty(0, dtype=runner.dtype, device=runner.device))
        times = time_alternately(runner, inputs, [stack for _, _, stack in cases], args.repeats, grouped)
        print(f"{'step':<26} {'rows':>4} {'adapters':>8} {'forward ms':>10} {'vs base':>7}")
        for (label, lora_names, _), model_input, ms, is_grouped in zip(cases, inputs, times, grouped):
            used = len({c.lora_id for c in model_input.decodes} - {0})
            row = {"step": label, "rows": args.batch, "adapters": used, "rank": args.rank,
                   "context": args.context, "dtype": dtype_label(runner), "forward_ms": round(ms, 3),
                   "vs_base": round(ms / times[0], 3),
                   "lora_product": "" if not used else "grouped" if is_grouped and kernel else "masked"}
            rows.append(row)
            print(f"{label:<26} {args.batch:>4} {used:>8} {row['forward_ms']:>10} {row['vs_base']:>7}", flush=True)
        for rid in engine.unfinished_request_ids():
            engine.abort(rid)
        engine.step()
    path = write_stamped_csv(rows, ctx, args.out, "lora")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
