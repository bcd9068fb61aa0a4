"""The engine step's fixed cost: the real model's structure with the arithmetic removed.

A random-weight decoder with SmolLM2-135M's 30 layers and its head size (64, so the
compiled attention kernel runs) but one attention head, a 64-wide residual and MLP
and a 256-token vocabulary: every op of the real step runs (embedding, 30 x (norm,
q/k/v, RoPE, KV write, paged attention, o, norm, SwiGLU), final norm, lm_head),
each on almost no data. What a step costs here is per-op dispatch, Python and
per-step bookkeeping, not arithmetic or weight bytes, with one exception: decode
attention still reads every cached token's K and V (B x context x 30 layers x 64
values x 2, bfloat16: 63 MB per step at 64 x 128), which grows with batch x context
and is bound by DRAM, not by dispatch. So the tiny model's decode attention is also
timed alone on the step's block tables twice, with the step's context lengths and with
every context cut to one token: the difference is the time spent reading the cache
(``kv read``), and ``fixed`` is the engine step less it (the attention calls' own
dispatch stays in ``fixed``).
Beside it, the real model's step on the same batches, so the fixed part's share of a
real step shows.

Per batch size B (B decoding sequences with ``--context`` tokens each), in ms, the
minimum over ``--repeats``:

- ``runner``: ``ModelRunner.execute`` of the decode step (the forward pass);
- ``engine``: a whole ``LLMEngine.step`` (schedule, build the step, forward, greedy
  sample, detokenize, outputs);
- ``kv read``: the tiny model's decode attention of all 30 layers alone on the step's
  block tables, with the step's context lengths less with one-token contexts;
- ``fixed``: tiny engine less kv read: what the step costs besides reading the cache;
- ``real runner`` / ``real engine``: the same on the real model (``--real off`` skips it);
- ``fixed share``: engine (tiny) / real engine.

Usage: ``python -m bench.fixed_cost [--batches 1,8,32,64] [--context 128] [--dtype auto]``
"""

from __future__ import annotations

import argparse
import shlex
import sys

from bench.options import add_out_option
from bench.profile_step import best_ms, default_block_size
from bench.report import context, write_stamped_csv
from bench.targets.engine import EngineTargetSettings, build_engine, dtype_label, load
from worker.engine.engine import EngineRequest
from worker.engine.sampling_params import SamplingParams

#: SmolLM2-135M's depth and head size, every width cut to one head (the arithmetic removed).
TINY_SHAPE = dict(num_layers=30, hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=64, vocab_size=256)


def tiny_structure_runner(dtype, block_size: int, num_blocks: int, quantization: str = "none"):
    """A random-weight runner with :data:`TINY_SHAPE` in ``dtype`` (torch dtype), its
    projections quantized by ``quantization`` and its KV cache in the dtype the
    worker's ``auto`` would choose."""
    from worker.model.dtype import resolve_kv_cache_dtype
    from worker.model.model_runner import tiny_random_runner

    head_dim = TINY_SHAPE["hidden_size"] // TINY_SHAPE["num_heads"]
    kv_dtype = resolve_kv_cache_dtype("auto", dtype, "cpu", head_dim, quantization)
    return tiny_random_runner(dtype=dtype, block_size=block_size, num_blocks=num_blocks, context_length=4096,
                              kv_cache_dtype=kv_dtype, quantization=quantization, **TINY_SHAPE)


class _TokenTokenizer:
    """Decodes ids as short words; enough for the engine's detokenizer."""

    eos_token_ids = frozenset()
    vocab_size = TINY_SHAPE["vocab_size"]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" t{i}" for i in ids)


def _decoding_engine(runner, tokenizer, batch: int, prompt_len: int, max_tokens: int):
    """An engine with ``batch`` sequences past their prefill, decoding (greedy) for up
    to ``max_tokens`` tokens."""
    settings = EngineTargetSettings(max_batch_size=batch, max_num_batched_tokens=max(2048, batch * prompt_len))
    engine = build_engine(runner, tokenizer, settings, "continuous")
    for i in range(batch):
        prompt = [(7 * i + j) % 200 + 1 for j in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert engine.add_request(EngineRequest(f"r{i}", prompt, params)).ok
    while engine.stats().num_running < batch or engine.scheduler.waiting:
        engine.step()
    engine.step()
    return engine


def kv_read_ms(runner, model_input, repeats: int) -> float:
    """The time every layer's decode attention spends reading the KV cache, ms: the min
    over ``repeats`` of all layers' attention alone, as the model calls it, for the
    decodes of ``model_input`` (their block tables and context lengths; a random query
    [B, heads, head_dim] in the runner's dtype), less the same with every context
    length 1 (the calls' dispatch and one token each)."""
    import torch

    from bench.profile_step import attention_fns
    from worker.model.model_runner import build_step

    meta = build_step(model_input.decodes, 0, runner.block_size, runner.device).meta
    cfg = runner.config
    q = torch.randn(len(model_input.decodes), cfg.num_heads, cfg.head_dim, dtype=runner.dtype)
    out = torch.empty_like(q)
    attend, _ = attention_fns()

    def all_layers(lens):
        for key_cache, value_cache in runner.cache.layers:
            attend(q, key_cache, value_cache, meta.decode_block_tables, lens, runner.model.scale, out=out)

    one_token = torch.ones_like(meta.decode_context_lens)
    with torch.inference_mode():
        full = best_ms(lambda: all_layers(meta.decode_context_lens), repeats)
        return max(0.0, full - best_ms(lambda: all_layers(one_token), repeats))


def measure(runner, tokenizer, batch: int, prompt_len: int, repeats: int) -> dict:
    """{runner, engine, kv_read} ms for ``batch`` decoding sequences on ``runner``."""
    engine = _decoding_engine(runner, tokenizer, batch, prompt_len, repeats + 8)  # the steps timed below
    sched = engine.scheduler.schedule()  # one step's input, run again and again (KV rewritten in place)
    forward = best_ms(lambda: runner.execute(sched.model_input), repeats)
    kv_read = kv_read_ms(runner, sched.model_input, repeats)
    whole = best_ms(engine.step, repeats)
    return {"runner": round(forward, 3), "engine": round(whole, 3), "kv_read": round(kv_read, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", choices=["none", "q8_0", "q4_1"])
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size in tokens (default: the worker's CPU default)")
    parser.add_argument("--real", default="on", choices=["on", "off"])
    parser.add_argument("--decode-stack", default="on",
                        help="comma list of on/off: q8_0 decode steps with their layers in one C++ call "
                             "(inflight_kernels.decode_stack) or from Python; one row per value and batch")
    add_out_option(parser)
    args = parser.parse_args(argv)
    ctx = context("python -m bench.fixed_cost " + shlex.join(argv if argv is not None else sys.argv[1:]))
    batches = [int(b) for b in args.batches.split(",") if b]
    block_size = args.block_size or default_block_size()
    blocks = max(batches) * (-(-(args.context + args.repeats + 8) // block_size)) + 8
    real = None
    if args.real == "on":
        real = load(EngineTargetSettings(dtype=args.dtype, quantization=args.quantization, block_size=block_size))
    dtype = real[0].dtype if real else __import__("torch").float32
    tiny = tiny_structure_runner(dtype, block_size, blocks, args.quantization)
    rows = []
    print(f"{'batch':>5} {'stack':>5} {'tiny runner':>11} {'tiny engine':>11} {'kv read':>8} {'fixed':>6} "
          f"{'real runner':>11} {'real engine':>11} {'fixed share':>11}")
    for batch, stack in [(b, s) for b in batches for s in args.decode_stack.split(",")]:
        for runner in [tiny] + ([real[0]] if real else []):
            runner.model.use_decode_stack = stack == "on"
        row = {"batch": batch, "dtype": dtype_label(real[0] if real else tiny), "context": args.context,
               "block_size": block_size,
               "decode_stack": stack}
        t = measure(tiny, _TokenTokenizer(), batch, args.context, args.repeats)
        row.update(tiny_runner_ms=t["runner"], tiny_engine_ms=t["engine"], tiny_kv_read_ms=t["kv_read"],
                   tiny_fixed_ms=round(t["engine"] - t["kv_read"], 3))
        if real:
            r = measure(real[0], real[1], batch, args.context, args.repeats)
            row.update(real_runner_ms=r["runner"], real_engine_ms=r["engine"],
                       fixed_share=round(t["engine"] / r["engine"], 3))
        rows.append(row)
        print(f"{batch:>5} {row['decode_stack']:>5} {row['tiny_runner_ms']:>11} {row['tiny_engine_ms']:>11} "
              f"{row['tiny_kv_read_ms']:>8} {row['tiny_fixed_ms']:>6} {row.get('real_runner_ms', '-'):>11} "
              f"{row.get('real_engine_ms', '-'):>11} {row.get('fixed_share', '-'):>11}", flush=True)
    path = write_stamped_csv(rows, ctx, args.out, "fixed-cost")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
