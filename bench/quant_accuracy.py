"""How far int8 quantization schemes move SmolLM2-135M's next-token
distribution, before anyone writes a kernel for one.

Each scheme is simulated in float32 ("fake quantization": round to the int8
grid, multiply back by the scale) on every projection of the decoder (qkv, o,
gate_up, down; the lm_head stays float32), so the table measures accuracy
only, not speed. Schemes (symmetric, zero point 0, levels ``±(2^(bits-1) - 1)``):

- ``W8 channel``: weights int8 with one scale per output channel, activations
  float32 (weight-only);
- ``W8A8 token``: plus activations int8 with one scale per row (token), the
  "per-token dynamic" W8A8 of SmoothQuant (Xiao et al. 2023) without smoothing;
- ``W8A7 token``: the same with 7-bit activations, the range fbgemm's x86
  kernels use (``reduce_range``) so that ``vpmaddubsw`` cannot saturate;
- ``W8A8 block32``: weights and activations with one scale per 32 values along
  the reduction dimension, llama.cpp's Q8_0 x Q8_0 (ggml-quants.c);
- ``W8 channel, A8 block32``: per-channel weights, per-32 activations;
- ``bfloat16``: weights and activations rounded to bfloat16, for scale: the
  error the worker already accepts where it computes in bfloat16 (AMX and
  AVX-512 BF16 CPUs).

The reference is the float32 model (the GGUF's Q4_1 weights dequantized, as
the worker runs them). It greedily continues each of ``--prompts`` prompts of
``bench/prompts.jsonl`` by ``--tokens`` tokens; every scheme then reads those
same token sequences (teacher forcing) and is scored at every position on:

- ``top-1``: the fraction of positions whose argmax equals the reference's;
- ``KL``: mean KL(reference || scheme) in nats per position.

``--speed-rows B`` also times, per decode step of B rows, the decoder's
projections and its lm_head with the float32 weights the worker runs
(oneDNN-prepacked, :mod:`worker.model.linear`) against the fastest int8 GEMM
torch ships for x86 CPUs, fbgemm's dynamic ``quantized.linear_dynamic``
(per-channel int8 weights, 7-bit per-tensor activations: the W8A7 row's
arithmetic, so an upper bound on what a per-token or per-block scheme would
gain on this CPU with library kernels).

Two last rows score the worker's own ``--quantization q8_0`` (the compiled
kernel of ``inflight_kernels/cpu/q8_gemm.cpp``, which quantizes the lm_head too) and
``--quantization q4_1`` (``inflight_kernels/cpu/q4_gemm.cpp``: the GGUF's own Q4_1 blocks
with int8 activations, the lm_head in Q8_0) the same way.

Writes ``bench/results/<stamp>-quant-accuracy.csv``. Results: bench/RESULTS.md run 15.

    python -m bench.quant_accuracy [--prompts 8] [--tokens 32] [--speed-rows 32] [--model M] [--gguf-only]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from inflight_kernels.reference import symmetric_round

RESULTS_DIR = Path(__file__).with_name("results")


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme.

    Attributes:
        name: the table's label.
        weight_block: values per weight scale along the input dimension (None = the whole row: per channel).
        act_bits: activation bits (None = activations stay float32).
        act_block: values per activation scale (None = the whole row: per token).
        bfloat16: instead of int8, round weights and activations to bfloat16.
    """

    name: str
    weight_block: int | None
    act_bits: int | None
    act_block: int | None
    bfloat16: bool = False


SCHEMES = (
    Scheme("W8 channel", None, None, None),
    Scheme("W8A8 token", None, 8, None),
    Scheme("W8A7 token", None, 7, None),
    Scheme("W8A8 block32", 32, 8, 32),
    Scheme("W8 channel, A8 block32", None, 8, 32),
    Scheme("bfloat16", None, None, None, bfloat16=True),
)


# Rounding to the int8 grid and back ("fake quantization"), the oracle's own rounding.
fake_quantize = symmetric_round


@dataclass(frozen=True)
class _FakeWeight:
    """A projection weight already on the int8 grid, plus how to round activations."""

    weight: torch.Tensor  # [out, in] float32
    scheme: Scheme


def _fake_linear(plain_linear):
    def linear(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
        if not isinstance(weight, _FakeWeight):
            return plain_linear(x, weight, bias)
        scheme = weight.scheme
        if scheme.bfloat16:
            x = x.bfloat16().float()
        elif scheme.act_bits is not None:
            x = fake_quantize(x.float(), scheme.act_bits, scheme.act_block)
        return F.linear(x, weight.weight, bias)
    return linear


def _plain(weight) -> torch.Tensor:
    """The ``[out, in]`` float weight of a projection as the decoder holds it."""
    from worker.model.linear import BF16Weight

    if isinstance(weight, BF16Weight):  # tiles of 16 columns, input pairs interleaved -> [out, in]
        tiles = weight.packed.view(weight.packed.shape[0], weight.in_features // 2, 16, 2)
        return tiles.permute(0, 2, 1, 3).reshape(-1, weight.in_features)[:weight.out_features]
    return weight.to_dense() if weight.layout == torch._mkldnn else weight  # oneDNN-packed -> [out, in]


@contextmanager
def quantized(model, scheme: Scheme) -> Iterator[None]:
    """``model``'s projections (:class:`worker.model.llama.LlamaDecoder`) fake-quantized
    with ``scheme`` inside the block, restored after it."""
    import worker.model.llama as llama

    def fake(weight: torch.Tensor) -> _FakeWeight:
        plain = _plain(weight).float()
        rounded = plain.bfloat16().float() if scheme.bfloat16 else fake_quantize(plain, 8, scheme.weight_block)
        return _FakeWeight(rounded, scheme)

    saved = model.layers
    model.layers = [replace(layer, qkv=fake(layer.qkv), o=fake(layer.o), gate_up=fake(layer.gate_up),
                            down=fake(layer.down)) for layer in saved]
    try:
        with mock.patch.object(llama, "linear", _fake_linear(llama.linear)):
            yield
    finally:
        model.layers = saved


def all_logits(runner, token_ids: list[int]) -> torch.Tensor:
    """float32 logits ``[len(token_ids), vocab]`` of one prefill of ``token_ids``
    (every position's next-token distribution) on ``runner``'s KV blocks 0..n."""
    from worker.runner_io import ScheduledChunk
    from worker.model.model_runner import build_step

    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    step = build_step([ScheduledChunk(0, token_ids, 0, blocks)], 1, runner.block_size, runner.device)
    with torch.inference_mode():
        return runner.model.forward(step.input_ids, step.positions, step.meta, runner.cache.layers,
                                    torch.arange(len(token_ids)))


def greedy_texts(runner, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt followed by ``tokens`` greedy tokens of ``runner``'s model."""
    texts = []
    for ids in prompts:
        ids = list(ids)
        for _ in range(tokens):
            ids.append(int(all_logits(runner, ids)[-1].argmax()))
        texts.append(ids)
    return texts


def score(runner, texts: list[list[int]], reference: list[torch.Tensor]) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || model) in nats) over every position of ``texts``."""
    agree = positions = 0
    kl = 0.0
    for ids, ref in zip(texts, reference):
        logits = all_logits(runner, ids)
        agree += int((logits.argmax(-1) == ref.argmax(-1)).sum())
        positions += len(ids)
        kl += float(F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"))
    return agree / positions, kl / positions


def _best_ms(fn) -> float:
    from bench.ceiling import best_seconds

    return best_seconds(fn, 20) * 1e3


def gemm_speed(model, rows: int) -> list[dict]:
    """ms per decode step of ``rows`` rows: the 30 layers' projections and the
    lm_head, float32 (as the worker runs them) against fbgemm int8 (see module docstring)."""
    import warnings

    from worker.model.linear import linear

    def int8(weight: torch.Tensor):
        plain = _plain(weight).float()
        scale = plain.abs().amax(1).clamp(min=1e-12) / 127
        with warnings.catch_warnings():  # torch's quantized tensors are deprecated, still shipped
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(plain, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)

    layer = model.layers[0]
    groups = {"projections": [(layer.qkv, len(model.layers)), (layer.o, len(model.layers)),
                              (layer.gate_up, len(model.layers)), (layer.down, len(model.layers))],
              "lm_head": [(model.lm_head, 1)]}
    out = []
    with torch.inference_mode():
        for name, weights in groups.items():
            fp32 = int8_ms = 0.0
            for weight, count in weights:
                x = torch.randn(rows, weight.shape[1])
                packed = int8(weight)
                fp32 += count * _best_ms(lambda: linear(x, weight))
                int8_ms += count * _best_ms(lambda: torch.ops.quantized.linear_dynamic(x, packed, True))
            out.append({"part": name, "rows": rows, "float32_ms": round(fp32, 2), "int8_ms": round(int8_ms, 2)})
    return out


def _kernel_row(model: str | None, quantization: str, texts: list[list[int]],
                reference: list[torch.Tensor], dtype: str = "float32", dense_min_rows: int | None = 0) -> dict | None:
    """The worker's ``--quantization`` ``quantization`` with ``--dtype`` ``dtype`` and
    ``--dense-weights-min-rows`` ``dense_min_rows`` (None: auto; the compiled kernels, lm_head
    included) scored like the schemes; None where it cannot run (no compiled CPU kernels, or no
    AVX-512 BF16 for gguf with bfloat16)."""
    from bench.targets.engine import EngineTargetSettings, load
    from worker.model.model_runner import dense_product_kinds

    try:
        runner, _ = load(EngineTargetSettings(model=model, dtype=dtype, kv_cache_mib=64,
                                              quantization=quantization, dense_weights_min_rows=dense_min_rows))
    except ValueError as exc:
        print(f"({quantization} kernel row skipped: {exc})")
        return None
    top1, kl = score(runner, texts, reference)
    head = {"q8_0": "lm_head too", "q4_1": "lm_head q8_0"}.get(quantization, "the file's blocks, weight-only")
    flags = f"--quantization {quantization}" + (f" --dtype {dtype}" if quantization == "gguf" else "")
    kinds = "; ".join(dense_product_kinds(runner.model))
    if dense_min_rows is None:
        rows = runner.model.dense_min_rows
        flags, head = f"{flags} --dense-weights-min-rows auto", (
            f"the worker's defaults: dense products from {rows} rows ({kinds})" if rows else "the worker's defaults")
    elif dense_min_rows:
        flags, head = f"{flags} --dense-weights-min-rows {dense_min_rows}", kinds or "no dense products"
    return {"scheme": f"{quantization} kernel ({flags}, {head})", "top1": round(top1, 4),
            "kl_nats": round(kl, 5)}


def main(argv: list[str] | None = None) -> int:
    """Print the table (one row per scheme) and write the CSV."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts of bench/prompts.jsonl to continue")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--model", default=None, help="as inflight bench's (default SmolLM2-135M-Instruct)")
    p.add_argument("--speed-rows", type=int, default=0, help="also time the GEMMs of a step of this many rows")
    p.add_argument("--gguf-only", action="store_true",
                   help="score only the worker's --quantization gguf (float32 activations, and the worker's "
                        "defaults: auto dtype and dense rows) against the dequantized float32 model (a K-quant "
                        "file's own blocks, issue 48), not the simulated schemes and int8 kernels")
    args = p.parse_args(argv)
    from bench.report import context
    from bench.targets.engine import EngineTargetSettings, load
    from bench.workloads import load_prompts

    runner, tokenizer = load(EngineTargetSettings(model=args.model, dtype="float32", kv_cache_mib=64,
                                                  quantization="none"))  # the dense float32 reference
    prompts = [tokenizer.encode(text) for text in load_prompts()[: args.prompts]]
    texts = greedy_texts(runner, prompts, args.tokens)
    reference = [all_logits(runner, ids) for ids in texts]
    ctx = context(" ".join(sys.argv))
    print(f"{ctx.cpu}, {ctx.cores} cores, commit {ctx.commit}; {len(texts)} texts, "
          f"{sum(map(len, texts))} positions\n\n| scheme | top-1 | KL nats |\n|---|---|---|")
    rows = []
    for scheme in () if args.gguf_only else SCHEMES:
        with quantized(runner.model, scheme):
            top1, kl = score(runner, texts, reference)
        rows.append({"scheme": scheme.name, "top1": round(top1, 4), "kl_nats": round(kl, 5)})
        print(f"| {scheme.name} | {top1:.4f} | {kl:.5f} |", flush=True)
    kernels = ((("gguf", "float32", 0), ("gguf", "auto", None)) if args.gguf_only else
               (("q8_0", "float32", 0), ("q4_1", "float32", 0), ("gguf", "float32", 0), ("gguf", "bfloat16", 0),
                ("gguf", "bfloat16", 1)))
    for quantization, dtype, dense in kernels:
        kernel = _kernel_row(args.model, quantization, texts, reference, dtype, dense)
        if kernel is not None:
            rows.append(kernel)
            print(f"| {kernel['scheme']} | {kernel['top1']:.4f} | {kernel['kl_nats']:.5f} |", flush=True)
    if args.speed_rows > 0:
        speed = gemm_speed(runner.model, args.speed_rows)
        print(f"\nGEMMs of one decode step, {args.speed_rows} rows\n\n| part | float32 ms | int8 (fbgemm) ms | ratio |"
              "\n|---|---|---|---|")
        for row in speed:
            print(f"| {row['part']} | {row['float32_ms']} | {row['int8_ms']} | "
                  f"{row['float32_ms'] / row['int8_ms']:.2f}x |")
        rows += speed
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-quant-accuracy.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["scheme", "top1", "kl_nats", "part", "rows", "float32_ms", "int8_ms", "commit",
                                    "cpu"], restval="")
        writer.writeheader()
        writer.writerows({**row, "commit": ctx.commit, "cpu": ctx.cpu} for row in rows)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
