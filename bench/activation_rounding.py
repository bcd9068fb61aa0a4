"""How far rounding only the activations of every linear layer moves a model's next-token
distribution: the choice behind the K-quant kernel's int16 activations with one scale per 256
values (``inflight_kernels/cpu/kquant_gemm.cpp``, issue 48).

The weights stay as the float32 reference holds them; each product's input is rounded
("fake quantization": to the symmetric integer grid of ``bits`` bits with one scale per
``block`` values along the reduction dimension, then multiplied back) or to bfloat16. Rows:
bfloat16 (what the worker accepts on CPUs with bfloat16 math), int8 per 32 (llama.cpp's Q8_0),
int8 per 256 (llama.cpp's Q8_K, what its K-quant dot products take), int12 per 32, int16 per 32
and int16 per 256 (ours). Scored as :mod:`bench.quant_accuracy` does: teacher-forced top-1
agreement and mean KL(reference || rounded) in nats over the reference's greedy texts.

``--by-projection``: the int8 roundings once per kind of projection (qkv, o, gate_up, down,
lm_head), every other product's input left as it is, to see whether any kind of projection
tolerates llama.cpp's int8 activations (run 45: none does on SmolLM2).

Writes ``bench/results/<stamp>-activation-rounding.csv``. Results: bench/RESULTS.md runs 36 and 45.

    python -m bench.activation_rounding [--model M] [--prompts 8] [--tokens 32] [--by-projection]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

from bench.quant_accuracy import RESULTS_DIR, all_logits, greedy_texts, score

PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")
ROUNDINGS = (("bfloat16", None, None), ("int8 per 32 (Q8_0)", 8, 32), ("int8 per 256 (Q8_K)", 8, 256),
             ("int12 per 32", 12, 32), ("int16 per 32", 16, 32), ("int16 per 256 (kquant_gemm.cpp)", 16, 256))


def round_activations(x: torch.Tensor, bits: int | None, block: int | None) -> torch.Tensor:
    """``x`` ``[..., n]`` rounded to bfloat16 (``bits`` None) or to ``bits``-bit integers with one
    scale (max |x| / (2^(bits-1) - 1)) per ``block`` values of the last dimension (zero-padded
    to a whole block), back in float32."""
    if bits is None:
        return x.bfloat16().float()
    n = x.shape[-1]
    pad = (-n) % block
    blocks = F.pad(x.float().reshape(-1, n), (0, pad)).reshape(-1, block)
    top = 2 ** (bits - 1) - 1
    scale = blocks.abs().amax(1, keepdim=True).clamp(min=1e-30) / top
    rounded = (torch.round(blocks / scale).clamp(-top, top) * scale).reshape(-1, n + pad)[:, :n]
    return rounded.reshape(x.shape)


def projection_kinds(model) -> dict[int, str]:
    """``id(weight) -> kind`` for every projection weight of a Llama-layout decoder (its
    layers' ``qkv``, ``o``, ``gate_up``, ``down`` and the ``lm_head``)."""
    kinds = {id(model.lm_head): "lm_head"}
    for layer in model.layers:
        kinds.update({id(getattr(layer, kind)): kind for kind in PROJECTIONS[:4]})
    return kinds


def cases(by_projection: bool) -> list[tuple[str, int | None, int | None, str | None]]:
    """(label, bits, block, projection kind or None for all) for each row of the table."""
    if not by_projection:
        return [(name, bits, block, None) for name, bits, block in ROUNDINGS]
    return [(f"{name}, {kind} only", bits, block, kind) for name, bits, block in ROUNDINGS if bits == 8
            for kind in PROJECTIONS]


def main(argv: list[str] | None = None) -> int:
    """Print the table and write the CSV."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts of bench/prompts.jsonl to continue")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--model", default=None, help="as inflight bench's (default SmolLM2-135M-Instruct)")
    p.add_argument("--by-projection", action="store_true",
                   help="the int8 roundings applied to one kind of projection at a time")
    args = p.parse_args(argv)
    import worker.model.llama as llama
    from bench.report import context
    from bench.targets.engine import EngineTargetSettings, load
    from bench.workloads import load_prompts

    runner, tokenizer = load(EngineTargetSettings(model=args.model, dtype="float32", kv_cache_mib=64,
                                                  quantization="none"))
    texts = greedy_texts(runner, [tokenizer.encode(t) for t in load_prompts()[: args.prompts]], args.tokens)
    reference = [all_logits(runner, ids) for ids in texts]
    ctx = context(" ".join(sys.argv))
    print(f"{ctx.cpu}, {ctx.cores} cores, commit {ctx.commit}; {len(texts)} texts, {sum(map(len, texts))} positions"
          "\n\n| activations | top-1 | KL nats |\n|---|---|---|")
    plain, rows = llama.linear, []
    kinds = projection_kinds(runner.model)
    for name, bits, block, only in cases(args.by_projection):
        def rounded(x, weight, bias=None, bits=bits, block=block, only=only):
            if only is None or kinds.get(id(weight)) == only:
                x = round_activations(x, bits, block)
            return plain(x, weight, bias)

        with mock.patch.object(llama, "linear", rounded):
            top1, kl = score(runner, texts, reference)
        rows.append({"activations": name, "top1": round(top1, 4), "kl_nats": f"{kl:.2e}"})
        print(f"| {name} | {top1:.4f} | {kl:.2e} |", flush=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-activation-rounding.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["activations", "top1", "kl_nats", "commit", "cpu"])
        writer.writeheader()
        writer.writerows({**row, "commit": ctx.commit, "cpu": ctx.cpu} for row in rows)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
