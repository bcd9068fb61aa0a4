"""One-shot GPU check of the whole engine (model, paged KV cache, CUDA kernels, scheduler).

Run on a CUDA machine from the repo root (no network needed):

    python bench/gpu_engine.py check --out gpu_engine.csv

1. Paged steps: random-weight models (SmolLM2's attention shape: 9 query heads,
   3 KV heads, head_dim 64; and a Qwen2-style GQA-4 head_dim 128 with q/k/v
   biases) run the same chunked-prefill + decode steps, scattered block tables
   and contexts past one 512-token partition, on the CPU in float32 (the
   reference, itself tested against transformers) and on the GPU in float32
   and bfloat16. Relative error = max|gpu - cpu| / max|cpu| over each step's
   logits; limits 1e-3 for float32 (TF32 off; an H200 gave 6.7e-5 and 3.6e-4,
   the CPU's own paths agree to 0), 5e-2 for bfloat16. The
   float32 checks use sharp attention (q/k weights with std 0.3), so position
   or cache errors show; bf16 rounding through sharp attention is itself 0.3-0.6
   of the largest logit, so the bfloat16 checks use std 0.05, where the CPU's
   own bfloat16 path is within 1.5-2.6e-2 of its float32 path.
2. Engine: greedy generation (ignore_eos) of 12 requests, prompts of 5..700
   tokens, on the CPU and on the GPU in float32 under each batching mode; the
   token ids must be equal.

Exit status 1 on any failed check. ``step-time DIR`` prints one decode step's wall
time at batch 1/32/256 and torch's profile of the largest. ``random-weights DIR`` writes random weights
(bfloat16 ``model.safetensors``) for the ``config.json`` in DIR, so that
``inflight bench --device cuda --model DIR`` times a model's shape on a machine
that cannot download it; ``shape SRC DST`` (run where the model is) copies a
model's config and tokenizer, without weights, into DST.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.ceiling import best_seconds  # noqa: E402
from bench.gpu_kernels import rel_error  # noqa: E402
from worker.runner_io import ModelInput, ScheduledChunk  # noqa: E402
from worker.model.model_config import ModelConfig  # noqa: E402
from worker.model.random_weights import random_llama_weights  # noqa: E402
from worker.model.model_runner import build_runner  # noqa: E402

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
QK_STD = {torch.float32: 0.3, torch.bfloat16: 0.05}  # q/k weight std per checked dtype (see docstring)
SHAPES = {
    "smollm2-attn": ModelConfig(hidden_size=576, num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                                intermediate_size=1536, vocab_size=1024, context_length=4096),
    "gqa4-d128-bias": ModelConfig(hidden_size=1024, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                                  intermediate_size=2048, vocab_size=1024, context_length=4096,
                                  attention_bias=True),
}
BLOCK_SIZE = 16
DEVICE = "cuda"  # tests set "cpu" to exercise the harness


def runner_for(config: ModelConfig, dtype: torch.dtype, device: str, num_blocks: int = 256, seed: int = 0,
               qk_std: float = 0.3):
    """A :class:`worker.model.model_runner.ModelRunner` with ``random_llama_weights(config, seed, qk_std=qk_std)``."""
    return build_runner(config, random_llama_weights(config, seed, qk_std=qk_std), dtype=dtype, device=device,
                        block_size=BLOCK_SIZE, num_blocks=num_blocks, kv_cache_bytes=None)


def paged_steps(vocab: int, num_blocks: int, seed: int = 0) -> list[ModelInput]:
    """Chunked prefills and decodes of three sequences (300, 45 and 1000 prompt
    tokens) on shuffled block tables; every chunk asks for logits."""
    gen = torch.Generator().manual_seed(seed)
    lengths = {1: 300, 2: 45, 3: 1000}
    seqs = {s: torch.randint(0, vocab, (n + 8,), generator=gen).tolist() for s, n in lengths.items()}
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = {}, 0
    for s, ids in seqs.items():
        need = -(-len(ids) // BLOCK_SIZE)
        tables[s], used = blocks[used:used + need], used + need

    def chunk(s: int, start: int, end: int) -> ScheduledChunk:
        return ScheduledChunk(s, seqs[s][start:end], start, tables[s])

    steps = [ModelInput(prefills=[chunk(1, 0, 300), chunk(2, 0, 45), chunk(3, 0, 512)]),
             ModelInput(prefills=[chunk(3, 512, 1000)], decodes=[chunk(1, 300, 301), chunk(2, 45, 46)])]
    for i in range(6):
        steps.append(ModelInput(decodes=[chunk(s, n + 1 + i, n + 2 + i) if s != 3 else chunk(s, n + i, n + 1 + i)
                                         for s, n in lengths.items()]))
    return steps


def check_paged_steps(name: str, config: ModelConfig, dtype: torch.dtype) -> dict:
    """One row: worst relative error over the steps, GPU (``dtype``) against CPU float32."""
    num_blocks, qk = 256, QK_STD[dtype]
    ref = runner_for(config, torch.float32, "cpu", num_blocks, qk_std=qk)
    dut = runner_for(config, dtype, DEVICE, num_blocks, qk_std=qk)
    worst = 0.0
    for step in paged_steps(config.vocab_size, num_blocks):
        want, got = ref.execute(step), dut.execute(step)
        assert got.seq_ids == want.seq_ids, (got.seq_ids, want.seq_ids)
        worst = max(worst, rel_error(got.logits.cpu(), want.logits))
    dtype_name = str(dtype).removeprefix("torch.")
    return {"check": f"paged steps {name}", "dtype": dtype_name, "rel_err": worst,
            "limit": TOLERANCE[dtype], "ok": worst <= TOLERANCE[dtype]}


@dataclass(frozen=True)
class GreedyRun:
    """Token ids generated per request id by one engine run."""

    tokens: dict[str, list[int]]


def greedy_run(device: str, batching: str, requests: list[tuple[str, list[int], int]]) -> GreedyRun:
    """Run ``requests`` (id, prompt ids, max_tokens) to the end, greedy and ignoring EOS."""
    from bench.tiny import ByteTokenizer
    from worker.engine.engine_config import EngineConfig
    from worker.engine.engine import EngineRequest, LLMEngine
    from worker.engine.sampling_params import SamplingParams

    config = replace(SHAPES["smollm2-attn"], vocab_size=256, context_length=2048)  # byte tokenizer's vocabulary
    runner = runner_for(config, torch.float32, device, num_blocks=512, seed=1)
    engine = LLMEngine(runner, ByteTokenizer(), EngineConfig(
        block_size=BLOCK_SIZE, num_blocks=runner.num_blocks, max_num_seqs=8, max_num_batched_tokens=512,
        batching=batching, max_batch_size=None if batching == "continuous" else 4, max_wait_ms=1.0))
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, max_tokens in requests:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert engine.add_request(EngineRequest(rid, prompt, params)).ok
    for _ in range(20_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return GreedyRun(tokens)


def engine_requests(seed: int = 0) -> list[tuple[str, list[int], int]]:
    """12 requests: prompt lengths 5..700 tokens, 24..64 new tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 40, 64, 100, 130, 200, 257, 333, 480, 512, 700]
    return [(f"r{i}", torch.randint(1, 255, (n,), generator=gen).tolist(), 24 + (i * 7) % 41)
            for i, n in enumerate(lengths)]


def check_engine() -> list[dict]:
    """Rows: GPU greedy tokens equal the CPU's, per batching mode."""
    requests = engine_requests()
    want = greedy_run("cpu", "continuous", requests)
    rows = []
    for mode in ("continuous", "static", "dynamic"):
        got = greedy_run(DEVICE, mode, requests)
        equal = sum(got.tokens[r] == want.tokens[r] for r, _, n in requests
                    if len(want.tokens[r]) == n)
        rows.append({"check": f"engine greedy {mode}", "dtype": "float32", "rel_err": "",
                     "limit": f"{equal}/{len(requests)} equal", "ok": equal == len(requests)})
    return rows


def _guarded(fn, *args) -> list[dict]:
    """Run a check; an exception becomes a failed row that names it."""
    try:
        out = fn(*args)
        return out if isinstance(out, list) else [out]
    except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
        import traceback

        traceback.print_exc()
        return [{"check": f"{fn.__name__}{args[:2]}", "dtype": "", "rel_err": "", "limit": "",
                 "ok": False, "error": f"{type(exc).__name__}: {exc}"}]


def run_checks() -> list[dict]:
    """Every check's row, in order."""
    rows = []
    for name, config in SHAPES.items():
        for dtype in TOLERANCE:
            rows += _guarded(check_paged_steps, name, config, dtype)
    rows += _guarded(check_engine)
    return rows


def print_table(rows: list[dict]) -> None:
    """One line per check."""
    for r in rows:
        err = f"{r['rel_err']:.2e}" if isinstance(r["rel_err"], float) else ""
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']:34} {r['dtype']:9} {err:>9} {r['limit']!s:>12} "
              f"{r.get('error', '')}")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} checks passed", flush=True)


def write_csv(path: Path, rows: list[dict]) -> None:
    """CSV with the device name on every row."""
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    fields = ["device", "torch", "check", "dtype", "rel_err", "limit", "ok", "error"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({"device": device, "torch": torch.__version__, "error": "", **r})


def write_shape(src: str, dst: Path) -> None:
    """Copy the config (as HF ``config.json``) and tokenizer of model ``src``
    (GGUF file or HF folder) into ``dst``, without weights."""
    from common.model_files import resolve_model_path
    from common.tokenizer import load_tokenizer
    from worker.model.loader import load_weights

    path = resolve_model_path(src)
    config, _ = load_weights(path)
    tok = load_tokenizer(path)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps({
        "model_type": "qwen2" if config.attention_bias else "llama", "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.context_length, "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": tok.bos_token_id, "eos_token_id": sorted(tok.eos_token_ids)}, indent=1))
    tok.hf.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}, indent=1))


def write_random_weights(folder: Path, seed: int = 0) -> None:
    """``folder/model.safetensors``: :func:`random_llama_weights` for ``folder/config.json``, in bfloat16."""
    from safetensors.torch import save_file

    from worker.model.safetensors_loader import hf_config

    config = hf_config(json.loads((folder / "config.json").read_text()))
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in random_llama_weights(config, seed).items()}
    save_file(weights, str(folder / "model.safetensors"))


def step_times(folder: Path, batches: list[int], context: int = 256, repeats: int = 10) -> None:
    """Print the wall time of one decode step (``ModelRunner.execute``, synchronized)
    of the model in ``folder`` in bfloat16 at each batch size, and a profile of
    the step at the largest: ops by CPU time and by device time."""
    from bench.profile_step import decode_input, block_tables
    from worker.model.model_runner import load_model_runner

    runner = load_model_runner(folder, dtype="bfloat16", device=DEVICE, num_blocks=max(batches) * 32)

    def decodes(batch: int):
        return decode_input(block_tables(batch, context, runner.block_size, runner.num_blocks, False), context)

    for batch in batches:
        step = decodes(batch)
        best = best_seconds(lambda: runner.execute(step), repeats, runner.device)
        print(f"decode step batch {batch:4d} context {context}: {best * 1e3:7.2f} ms  "
              f"({batch / best:8.0f} tok/s)", flush=True)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        runner.execute(decodes(batches[-1]))
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by=sort, row_limit=8))


def main(argv: list[str] | None = None) -> int:
    """``check --out CSV`` | ``step-time DIR`` | ``shape SRC DST`` | ``random-weights DIR``
    (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("check").add_argument("--out", type=Path, required=True)
    shape = sub.add_parser("shape")
    shape.add_argument("src")
    shape.add_argument("dst", type=Path)
    sub.add_parser("random-weights").add_argument("folder", type=Path)
    steps = sub.add_parser("step-time")
    steps.add_argument("folder", type=Path)
    steps.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    args = p.parse_args(argv)
    if args.command == "step-time":
        step_times(args.folder, args.batches)
        return 0
    if args.command == "shape":
        write_shape(args.src, args.dst)
        return 0
    if args.command == "random-weights":
        write_random_weights(args.folder)
        return 0
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 checks compare against float32
    rows = run_checks()
    print_table(rows)
    write_csv(args.out, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
