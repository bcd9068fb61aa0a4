"""LoRA in the continuous batch: a decode step whose rows use several adapters against the
base model's step (issue 44 item 9; goal: at most 1.3x).

B sequences (``--batch``, 32) decode with ``--context`` tokens each, and the runner's
forward pass of one decode step is timed (the minimum over ``--repeats``), for:

- ``base``: every row the base model, the step as it runs today (on the CPU with GGUF blocks
  its layers run in one C++ call, ``inflight_kernels.decode_stack``);
- ``base, layer path``: the same rows through the layer-by-layer path, the path every step
  with LoRA rows takes (the C++ stack has no LoRA), so the LoRA product's own cost shows;
- ``N adapters``: every row one of ``--adapters`` random rank-``--rank`` adapters (all seven
  projections adapted, the rows dealt round robin);
- ``base + N adapters``: half the rows the base model, the rest dealt over the adapters.

The adapters are written in PEFT's format (random weights, every projection adapted) into a
temporary folder and loaded through ``LLMEngine.add_lora``, as ``--lora-modules`` loads them.
The ratio column is each step over ``base``. The product is :mod:`worker.model.lora_batch`.

Usage: ``python -m bench.lora [--batch 32] [--adapters 4] [--rank 16] [--context 128]``
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from bench.options import add_out_option
from bench.profile_step import best_ms
from bench.report import context, write_stamped_csv
from bench.targets.engine import EngineTargetSettings, dtype_label, load
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.engine_config import EngineConfig
from worker.engine.sampling_params import SamplingParams

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


def start(engine: LLMEngine, lora_names: list[str], prompt_len: int, max_tokens: int) -> None:
    """Add one request per row and step until every row decodes."""
    for i, name in enumerate(lora_names):
        prompt = [(7 * i + j) % 200 + 1 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        result = engine.add_request(EngineRequest(f"r{i}", prompt, params, lora_name=name))
        assert result.ok, result.reason
    while engine.stats().num_running < len(lora_names) or engine.scheduler.waiting:
        engine.step()
    engine.step()


def step_ms(runner, tokenizer, adapters: dict[str, str], lora_names: list[str], prompt_len: int,
            repeats: int) -> float:
    """The forward pass of one decode step of ``lora_names``' rows, ms (min over ``repeats``)."""
    engine = decoding_engine(runner, tokenizer, len(lora_names), prompt_len, max(1, len(adapters)))
    for name, path in adapters.items():
        engine.add_lora(name, path)
    start(engine, lora_names, prompt_len, repeats + 8)
    sched = engine.scheduler.schedule()  # one step's input, run again and again (KV rewritten in place)
    decodes = sched.model_input.decodes
    assert len(decodes) == len(lora_names) and sum(c.lora_id > 0 for c in decodes) == sum(map(bool, lora_names))
    ms = best_ms(lambda: runner.execute(sched.model_input), repeats)
    for rid in engine.unfinished_request_ids():
        engine.abort(rid)
    engine.step()
    for name in adapters:
        engine.remove_lora(name)
    return ms


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
    cases = [("base", [""] * args.batch, True), ("base, layer path", [""] * args.batch, False),
             (f"{args.adapters} adapters", [names[i % len(names)] for i in range(args.batch)], True),
             (f"base + {args.adapters} adapters",
              [""] * half + [names[i % len(names)] for i in range(args.batch - half)], True)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        adapters = {name: write_random_adapter(Path(tmp) / name, runner.config, args.rank, seed)
                    for seed, name in enumerate(names, start=1)}
        print(f"{'step':<22} {'rows':>4} {'adapters':>8} {'forward ms':>10} {'vs base':>7}")
        base_ms = None
        for label, lora_names, stack in cases:
            runner.model.use_decode_stack = stack
            used = {n: p for n, p in adapters.items() if n in lora_names}
            ms = step_ms(runner, tokenizer, used, lora_names, args.context, args.repeats)
            base_ms = base_ms or ms
            row = {"step": label, "rows": args.batch, "adapters": len(used), "rank": args.rank,
                   "context": args.context, "dtype": dtype_label(runner), "forward_ms": round(ms, 3),
                   "vs_base": round(ms / base_ms, 3)}
            rows.append(row)
            print(f"{label:<22} {args.batch:>4} {len(used):>8} {row['forward_ms']:>10} {row['vs_base']:>7}",
                  flush=True)
        runner.model.use_decode_stack = True
    path = write_stamped_csv(rows, ctx, args.out, "lora")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
