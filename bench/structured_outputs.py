"""Structured outputs: the grammar engines side by side, the mask's share of a step, and the
time to first token a new or a cached schema adds.

Three parts, one CSV (``part`` column):

1. ``backend``: llguidance and (when installed) xgrammar on the schema corpus
   (``bench/schema_corpus.py``, 60 schemas) with SmolLM2's tokenizer: per schema the cold
   compile plus the first token mask (ms), then the per-step mask fill of a batch of
   ``--batch`` matchers (one per schema, each fed a valid instance of its schema token by
   token, the tokens a random-weight model wrote under llguidance's mask), with each
   library's batch API (llguidance's ``LLExecutor``, xgrammar's ``BatchGrammarMatcher``, 2
   threads each); the libraries take turns schema by schema and step by step.
2. ``step``: the real engine (SmolLM2) at ``--batch`` decoding rows, half of them
   constrained (each an array of 50 objects of a corpus schema, so it never finishes early),
   the other half free; the grammar's time per step (mask fill + applying it + advancing the
   matchers) against the whole step, and the same batch with no grammar at all, the two
   engines stepping in turn (``constrained_over_free_step``: the median of the paired ratios).
3. ``ttft``: one request alone; time to its first token with a schema never seen before
   (a compile), with the same schema again (cached) and without one, for ``--ttft-schemas``
   schemas; the gateway's check of a new schema (validate + first mask); and the worker's
   compile alone, new and cached (what a request waits for before it joins the batch).

Usage: ``python -m bench.structured_outputs [--batch 32] [--steps 24] [--ttft-schemas 8]
[--parts backend step ttft]``
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from typing import Any, Callable

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from bench.options import add_out_option
from bench.report import context, write_stamped_csv
from bench.schema_corpus import corpus
from common.model_files import default_model_path
from common.structured_outputs import JSON_OPTIONS, StructuredOutputs
from common.tokenizer import load_tokenizer


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3


def valid_paths(tokenizer: Any, schemas: list[dict]) -> list[list[int]]:
    """One valid instance of each schema, as token ids: what a tiny random-weight model
    writes at temperature 1 under llguidance's mask (the engine, seeded)."""
    from worker.engine.engine import EngineRequest, LLMEngine
    from worker.engine.engine_config import EngineConfig
    from worker.engine.sampling_params import GrammarSpec, SamplingParams
    from worker.model.model_runner import tiny_random_runner

    runner = tiny_random_runner(vocab_size=tokenizer.vocab_size, block_size=16, num_blocks=1024)
    engine = LLMEngine(runner, tokenizer, EngineConfig(block_size=16))
    for k, schema in enumerate(schemas):
        spec = StructuredOutputs.json_schema(schema)
        engine.add_request(EngineRequest(str(k), tokenizer.encode("JSON:"), SamplingParams(
            max_tokens=300, temperature=1.0, seed=k, grammar=GrammarSpec(spec.key(), spec.grammar()))))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return [tokens[str(k)] for k in range(len(schemas))]


class Llguidance:
    """llguidance behind the bench's small backend interface."""

    name = "llguidance"

    def __init__(self, tokenizer: Any):
        started = time.perf_counter()
        self.tok = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=tokenizer.vocab_size,
                                          eos_token=sorted(tokenizer.eos_token_ids))
        self.setup_ms = _ms(started)
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.words = (tokenizer.vocab_size + 31) // 32

    def compile(self, schema: dict) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        matcher = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def first_mask(self, matcher: Any) -> None:
        mask = np.zeros((1, self.words), dtype=np.int32)
        llg_numpy.fill_next_token_bitmask(matcher, mask)

    def fill(self, matchers: list[Any], mask: np.ndarray) -> None:
        llg_numpy.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def allocate(self, rows: int) -> np.ndarray:
        return np.zeros((rows, self.words), dtype=np.int32)


class Xgrammar:
    """xgrammar (imports torch: worker side only) behind the same interface."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any):
        import transformers
        import xgrammar

        self.xgr = xgrammar
        started = time.perf_counter()
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size,
                                                       stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.setup_ms = _ms(started)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)
        self.vocab = tokenizer.vocab_size

    def compile(self, schema: dict) -> Any:
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")))  # compact, as ours

    def first_mask(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.xgr.allocate_token_bitmask(1, self.vocab))

    def fill(self, matchers: list[Any], mask: Any) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def allocate(self, rows: int) -> Any:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)


def bench_backends(backends: list[Any], schemas: list[dict], paths: list[list[int]], batch: int) -> list[dict]:
    """Cold compile + first mask per schema, then the batch's mask fill per step; the
    backends take turns schema by schema and step by step (load falls on all alike)."""
    rows, ok = [], {b.name: [] for b in backends}
    for k, schema in enumerate(schemas):
        for backend in backends:
            started = time.perf_counter()
            try:
                backend.first_mask(backend.compile(schema))
            except Exception as exc:  # noqa: BLE001 - an unsupported schema is a result here
                rows.append(dict(part="backend", backend=backend.name, schema=k, metric="compile_error",
                                 value=str(exc)[:80]))
            else:
                rows.append(dict(part="backend", backend=backend.name, schema=k, metric="compile_first_mask_ms",
                                 value=round(_ms(started), 3)))
                ok[backend.name].append(k)
    chosen = [k for k in range(len(schemas)) if all(k in ok[b.name] for b in backends)][:batch]
    matchers = {b.name: [b.compile(schemas[k]) for k in chosen] for b in backends}  # fresh state
    masks = {b.name: b.allocate(len(chosen)) for b in backends}
    fills: dict[str, list[float]] = {b.name: [] for b in backends}
    rejected = {b.name: 0 for b in backends}
    for step in range(min(len(paths[k]) for k in chosen)):
        for backend in backends:
            started = time.perf_counter()
            backend.fill(matchers[backend.name], masks[backend.name])
            fills[backend.name].append(_ms(started))
            rejected[backend.name] += sum(not backend.accept(m, paths[k][step])
                                          for m, k in zip(matchers[backend.name], chosen))
    for backend in backends:
        rows += [dict(part="backend", backend=backend.name, schema="batch", metric="fill_ms_per_step_median",
                      value=round(statistics.median(fills[backend.name]), 3)),
                 dict(part="backend", backend=backend.name, schema="batch", metric="fill_batch_rows",
                      value=len(chosen)),
                 dict(part="backend", backend=backend.name, schema="batch", metric="rejected_tokens",
                      value=rejected[backend.name]),
                 dict(part="backend", backend=backend.name, schema="setup", metric="tokenizer_setup_ms",
                      value=round(backend.setup_ms, 1))]
    return rows


def _timed(owner: Any, name: str, spent: list[float]) -> None:
    """Wrap ``owner.name`` so each call adds its milliseconds to ``spent``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(_ms(started))
    setattr(owner, name, wrapper)


def _decoding_batch(tokenizer: Any, runner: Any, schemas: list[dict], batch: int, steps: int,
                    constrained: bool) -> Any:
    """An engine whose ``batch`` rows all decode (compiles done, prompts prefilled); with
    ``constrained`` every other row writes an array of 50 objects of a corpus schema."""
    from worker.engine.engine import EngineRequest, LLMEngine
    from worker.engine.engine_config import EngineConfig
    from worker.engine.sampling_params import GrammarSpec, SamplingParams

    engine = LLMEngine(runner, tokenizer, EngineConfig(block_size=runner.block_size))
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Write the JSON."}])
    for k in range(batch):
        grammar = None
        if constrained and k % 2 == 0:
            item = {key: v for key, v in schemas[k // 2].items() if key != "$defs"}
            spec = StructuredOutputs.json_schema({"type": "array", "items": item, "minItems": 50, "maxItems": 50,
                                                  "$defs": schemas[k // 2].get("$defs", {})})
            grammar = GrammarSpec(spec.key(), spec.grammar())
        engine.add_request(EngineRequest(str(k), prompt, SamplingParams(
            max_tokens=steps + 8, temperature=1.0, seed=k, ignore_eos=True, grammar=grammar)))
    for _ in range(200):
        finished = [out for out in engine.step() if out.finished]
        if finished:
            raise RuntimeError(f"request {finished[0].request_id} ended during warm-up: {finished[0].finish_reason}")
        if not engine.grammars.num_waiting and engine.stats().num_running == batch and all(
                s.is_decode for s in engine.scheduler.running):
            return engine
    raise RuntimeError("the batch did not reach decoding")


def bench_step(tokenizer: Any, runners: tuple[Any, Any], schemas: list[dict], batch: int, steps: int) -> list[dict]:
    """Step time with half the rows constrained against none, the two engines (each on its
    own runner: a runner's KV cache belongs to one engine) stepping in turn, so load on a
    shared machine falls on both alike; and the grammar's own time per step (mask fill,
    applying it, advancing the matchers) on the constrained one."""
    from worker.engine import sampler as sampler_module

    engines = {True: _decoding_batch(tokenizer, runners[0], schemas, batch, steps, True),
               False: _decoding_batch(tokenizer, runners[1], schemas, batch, steps, False)}
    grammar_ms: list[float] = []
    _timed(engines[True].grammars, "bitmask", grammar_ms)
    _timed(engines[True].grammars, "advance", grammar_ms)
    original_apply = sampler_module.apply_token_bitmask
    _timed(sampler_module, "apply_token_bitmask", grammar_ms)
    step_ms: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(steps):
            for constrained, engine in engines.items():
                started = time.perf_counter()
                engine.step()
                step_ms[constrained].append(_ms(started))
    finally:
        sampler_module.apply_token_bitmask = original_apply
    rows = []
    for constrained, engine in engines.items():
        for rid in engine.unfinished_request_ids():
            engine.abort(rid)
        engine.step()
        total = statistics.median(step_ms[constrained])
        per_step = sum(grammar_ms) / steps if constrained else 0.0
        label = f"{batch // 2}/{batch} constrained" if constrained else f"0/{batch} constrained"
        rows += [dict(part="step", backend="llguidance", schema=label, metric="step_ms_median", value=round(total, 2)),
                 dict(part="step", backend="llguidance", schema=label, metric="grammar_ms_per_step",
                      value=round(per_step, 2)),
                 dict(part="step", backend="llguidance", schema=label, metric="grammar_share_of_step",
                      value=round(per_step / total, 4))]
    ratio = statistics.median(a / b for a, b in zip(step_ms[True], step_ms[False]))
    rows.append(dict(part="step", backend="llguidance", schema="paired", metric="constrained_over_free_step",
                     value=round(ratio, 3)))
    return rows


def _first_token_ms(engine: Any, request: Any) -> float:
    started = time.perf_counter()
    engine.add_request(request)
    while True:
        for out in engine.step():
            if out.request_id == request.request_id and out.token_ids:
                ms = _ms(started)
                engine.abort(request.request_id)
                while engine.has_unfinished():
                    engine.step()
                return ms


def bench_ttft(tokenizer: Any, runner: Any, schemas: list[dict], count: int) -> list[dict]:
    """Time to the first token of one request alone: a new schema, the same again, none."""
    from worker.engine.engine import EngineRequest, LLMEngine
    from worker.engine.engine_config import EngineConfig
    from worker.engine.sampling_params import GrammarSpec, SamplingParams

    engine = LLMEngine(runner, tokenizer, EngineConfig(block_size=runner.block_size, enable_prefix_caching=False))
    checker = Llguidance(tokenizer)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Write the JSON."}])
    times: dict[str, list[float]] = {"ttft_new": [], "ttft_cached": [], "ttft_none": [], "gateway_check_new": []}
    stamp = time.time()
    for k, schema in enumerate(schemas[:count]):
        spec = StructuredOutputs.json_schema({**schema, "$comment": f"bench {stamp} {k}"})  # never seen
        started = time.perf_counter()
        error = llguidance.LLMatcher.validate_grammar(spec.grammar(), checker.tok)
        checker.first_mask(checker.compile({**schema, "$comment": f"check {stamp} {k}"}))
        times["gateway_check_new"].append(_ms(started))
        assert not error, error
        grammar = GrammarSpec(spec.key(), spec.grammar())
        for case in ("new", "cached", "none"):
            params = SamplingParams(max_tokens=4, temperature=0.0, grammar=None if case == "none" else grammar)
            times[f"ttft_{case}"].append(_first_token_ms(engine, EngineRequest(f"{case}{k}", prompt, params)))
    from worker.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, runner.vocab_size)
    compiler.ll_tokenizer()
    times["worker_compile_new"], times["worker_compile_cached"] = [], []
    for k, schema in enumerate(schemas[:count]):  # the compile a request waits for, alone
        spec = StructuredOutputs.json_schema({**schema, "$comment": f"compile {stamp} {k}"})
        grammar = GrammarSpec(spec.key(), spec.grammar())
        for case in ("new", "cached"):
            started = time.perf_counter()
            compiler.compile(grammar).result()
            times[f"worker_compile_{case}"].append(_ms(started))
    return [dict(part="ttft", backend="llguidance", schema=f"{count} schemas", metric=f"{case}_ms_median",
                 value=round(statistics.median(values), 3)) for case, values in times.items()]


def _backends(tokenizer: Any, names: list[str]) -> list[Any]:
    """The libraries asked for; xgrammar (not a dependency of this project: ``pip install
    xgrammar``) is left out with a note when it is not installed."""
    found: list[Any] = [Llguidance(tokenizer)] if "llguidance" in names else []
    if "xgrammar" in names:
        try:
            found.append(Xgrammar(tokenizer))
        except ImportError as exc:
            print(f"xgrammar not installed, compared without it ({exc})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--schemas", type=int, default=60, help="corpus schemas used (at most 60)")
    parser.add_argument("--backends", nargs="+", default=["llguidance", "xgrammar"], choices=["llguidance", "xgrammar"])
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per case (part step)")
    parser.add_argument("--ttft-schemas", type=int, default=8)
    parser.add_argument("--parts", nargs="+", default=["backend", "step", "ttft"], choices=["backend", "step", "ttft"])
    parser.add_argument("--dtype", default="float32")
    add_out_option(parser)
    args = parser.parse_args(argv)
    ctx = context("python -m bench.structured_outputs " + shlex.join(argv if argv is not None else sys.argv[1:]))
    tokenizer = load_tokenizer(default_model_path())
    schemas = corpus()[:args.schemas]
    rows: list[dict] = []
    if "backend" in args.parts:
        paths = valid_paths(tokenizer, schemas)
        rows += bench_backends(_backends(tokenizer, args.backends), schemas, paths, args.batch)
    if "step" in args.parts or "ttft" in args.parts:
        from worker.model.model_runner import load_model_runner

        runner = load_model_runner(default_model_path(), dtype=args.dtype, num_blocks=1024)
        if "step" in args.parts:
            other = load_model_runner(default_model_path(), dtype=args.dtype, num_blocks=1024)
            rows += bench_step(tokenizer, (runner, other), schemas, args.batch, args.steps)
            del other
        if "ttft" in args.parts:
            rows += bench_ttft(tokenizer, runner, schemas, args.ttft_schemas)
    print_table(rows)
    path = write_stamped_csv(rows, ctx, args.out, "structured-outputs")
    print(f"wrote {path}")
    return 0


def print_table(rows: list[dict]) -> None:
    """The summary (compile times as median / p90 / max over the schemas), then the rest."""
    compile_rows: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for row in rows:
        if row["metric"] == "compile_first_mask_ms":
            compile_rows.setdefault(row["backend"], []).append(row["value"])
        elif row["metric"] == "compile_error":
            errors[row["backend"]] = errors.get(row["backend"], 0) + 1
    for name, values in compile_rows.items():
        values.sort()
        print(f"{name:<11} compile+first mask over {len(values)} schemas: median {statistics.median(values):.2f} ms, "
              f"p90 {values[int(0.9 * (len(values) - 1))]:.2f} ms, max {values[-1]:.2f} ms; "
              f"unsupported: {errors.get(name, 0)}")
    print(f"{'part':<8} {'backend':<11} {'case':<18} {'metric':<28} {'value':>10}")
    for row in rows:
        if row["metric"] not in ("compile_first_mask_ms", "compile_error"):
            print(f"{row['part']:<8} {row['backend']:<11} {str(row['schema']):<18} {row['metric']:<28} {row['value']:>10}")


if __name__ == "__main__":
    raise SystemExit(main())
