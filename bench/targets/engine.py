"""``--target engine``: the in-process :class:`worker.engine.engine.LLMEngine`, built
as ``worker.serve.main.build_engine`` builds it, driven with ``add_request``/``step``
against an arrival clock (each request is added once its arrival time has
passed; the engine's clock is the same ``time.perf_counter``).

Iteration-level scheduling (Orca, Yu et al. OSDI'22) shows in the occupancy
samples taken from ``stats()`` after every step.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from bench.metrics import RequestRecord, RunResult
from bench.workloads import BenchRequest
from worker.engine.engine_config import EngineConfig, SpeculativeConfig
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineTargetSettings:
    """Engine settings (mirroring :class:`worker.serve.settings.WorkerSettings`).

    Attributes:
        model: model spec (None = SmolLM2-135M-Instruct, "tiny" = random test model).
        dtype: "auto" | "float32" | "bfloat16".
        kv_cache_dtype: "auto" | "float32" | "bfloat16" | "float16", as the worker's
            (:func:`worker.model.dtype.resolve_kv_cache_dtype`).
        max_batch_size: sequences per batch in every mode.
        max_wait_ms: dynamic batching wait, milliseconds.
        max_num_batched_tokens: per-step token budget, tokens.
        long_prefill_token_threshold: most prompt tokens one sequence prefills per
            step, tokens (0 = off), as the worker's.
        block_size: tokens per KV block.
        kv_cache_mib: KV pool size, MiB (None = the device's default, as the worker's).
        prefix_cache: reuse cached full KV blocks of equal prompt prefixes
            (``EngineConfig.enable_prefix_caching``; off = ``--no-prefix-cache``).
        device: where the model and KV cache live, as the worker's ``--device``
            (:func:`worker.model.device.resolve_device`).
        quantization: "auto" | "none" | "gguf" | "q8_0" | "q4_1", as the worker's
            (:mod:`worker.model.quantization`).
        dense_weights_min_rows: as the worker's ``--dense-weights-min-rows`` (None = auto).
        speculative: speculative decoding, as the worker's ``--speculative-config``
            (None = off).
    """

    model: str | None = None
    dtype: str = "auto"
    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    block_size: int = 16
    kv_cache_mib: int | None = None
    prefix_cache: bool = True
    device: str = "cpu"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    dense_weights_min_rows: int | None = None
    speculative: SpeculativeConfig | None = None


def dtype_label(runner) -> str:
    """The compute dtype's name, with the KV cache's when it differs and the
    weight quantization when there is one (e.g. ``"float32, kv float16, q8_0"``):
    the bench tables' dtype cell; ``gguf`` whose block products round their activations to
    bfloat16 reads ``gguf bf16-act``, and with dense copies for steps of 16 rows or more
    ``gguf bf16-act dense>=16``."""
    compute = str(runner.dtype).removeprefix("torch.")
    cache = str(runner.cache.spec.dtype).removeprefix("torch.")
    label = compute if cache == compute else f"{compute}, kv {cache}"
    quantization = getattr(runner.model, "quantization", "none")
    layers = getattr(runner.model, "layers", None) or [None]
    if getattr(getattr(layers[0], "gate_up", None), "bf16_activations", False):
        quantization += " bf16-act"
    if getattr(runner.model, "dense_min_rows", 0):
        quantization += f" dense>={runner.model.dense_min_rows}"
    return label if quantization == "none" else f"{label}, {quantization}"


def load(settings: EngineTargetSettings):
    """(runner, tokenizer) for ``settings.model``, loaded once and shared by every mode.

    Raises:
        ValueError: an unusable ``settings.device``; FileNotFoundError: no such model.
    """
    from worker.model.device import resolve_device

    device = resolve_device(settings.device)
    if settings.model == "tiny":
        from bench.tiny import ByteTokenizer, tiny_runner

        return tiny_runner(device=device), ByteTokenizer()
    from common.model_files import resolve_model_path
    from common.tokenizer import load_tokenizer
    from worker.model.model_runner import load_model_runner

    path = resolve_model_path(settings.model)
    runner = load_model_runner(path, dtype=settings.dtype, device=device, block_size=settings.block_size,
                               kv_cache_bytes=None if settings.kv_cache_mib is None else settings.kv_cache_mib * 2 ** 20,
                               kv_cache_dtype=settings.kv_cache_dtype, quantization=settings.quantization,
                               dense_min_rows=settings.dense_weights_min_rows)
    return runner, load_tokenizer(path)


def build_engine(runner, tokenizer, settings: EngineTargetSettings, mode: str) -> LLMEngine:
    """A fresh engine over ``runner`` with the config ``worker.serve.main.build_engine`` would make."""
    config = EngineConfig(block_size=runner.block_size, num_blocks=runner.num_blocks,
                          max_num_seqs=settings.max_batch_size,
                          max_num_batched_tokens=settings.max_num_batched_tokens,
                          long_prefill_token_threshold=settings.long_prefill_token_threshold, batching=mode,
                          max_batch_size=None if mode == "continuous" else settings.max_batch_size,
                          max_wait_ms=settings.max_wait_ms, enable_prefix_caching=settings.prefix_cache,
                          speculative=settings.speculative)
    return LLMEngine(runner, tokenizer, config, clock=time.perf_counter)


def chat_token_ids(tokenizer, prompt: str, system: str = "") -> list[int]:
    """Prompt token ids of a one-turn chat (after ``system``, if any) with the model's template."""
    messages = [{"role": "system", "content": system}] if system else []
    text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class _Run:
    engine: LLMEngine
    t0: float
    records: dict[str, RequestRecord]
    occupancy: list[tuple[float, int]]

    def now(self) -> float:
        return time.perf_counter() - self.t0


def run(engine: LLMEngine, tokenizer, requests: list[BenchRequest], system: str = "inflight-engine",
        mode: str | None = None) -> RunResult:
    """Drive ``engine`` through ``requests`` (sorted by arrival) until all
    finish; ``mode`` labels the row (default: the batching mode). The
    result carries the engine's prefix-cache hit ratio (hit tokens over
    queried prompt tokens, ``stats().prefix_cache_hit_ratio``)."""
    state = _Run(engine, time.perf_counter(), {}, [(0.0, 0)])
    pending = deque(requests)
    while pending or engine.has_unfinished():
        _admit_arrived(state, pending, tokenizer)
        outputs = engine.step()
        t = state.now()
        stats = engine.stats()
        state.occupancy.append((t, stats.num_running))
        for out in outputs:
            _record(state.records[out.request_id], out, t)
        if not outputs and stats.last_batch_size == 0:
            _idle(state, pending)
    return RunResult(system, mode or engine.config.batching, list(state.records.values()), state.occupancy,
                     engine.config.request_batch_size, dtype_label(engine.runner),
                     "running sequences from engine.stats() after every step",
                     prefix_cache_hit_ratio=engine.stats().prefix_cache_hit_ratio)


def _admit_arrived(state: _Run, pending: deque, tokenizer) -> None:
    while pending and pending[0].arrival_s <= state.now():
        req = pending.popleft()
        params = SamplingParams(max_tokens=req.output_tokens, temperature=0.0, ignore_eos=True)
        record = RequestRecord(req.request_id, req.arrival_s, req.output_tokens)
        state.records[req.request_id] = record
        result = state.engine.add_request(EngineRequest(req.request_id, chat_token_ids(tokenizer, req.prompt, req.system),
                                                        params, arrival_time=state.t0 + req.arrival_s))
        if not result.ok:
            record.error, record.end_s = f"{result.status.value}: {result.reason}", state.now()


def _record(record: RequestRecord, out, t: float) -> None:
    record.token_times.extend([t] * len(out.token_ids))
    record.output_tokens = out.completion_tokens
    if out.finished:
        record.end_s = t
        if out.finish_reason in ("abort", "error"):
            record.error = out.finish_reason


def _idle(state: _Run, pending: deque) -> None:
    """Nothing ran: flush static batching's last partial batch once no more
    requests will come, else sleep until the next arrival or batch start."""
    engine, stats = state.engine, state.engine.stats()
    if not pending and stats.num_waiting and not stats.num_running and engine.config.batching != "continuous":
        # A static server never fills its last batch; the bench starts it (as a shutdown flush would).
        engine.scheduler.config = dataclasses.replace(engine.config, max_batch_size=stats.num_waiting)
        return
    wake = [state.t0 + pending[0].arrival_s] if pending else []
    if engine.next_batch_at() is not None:
        wake.append(engine.next_batch_at())
    if wake:
        time.sleep(min(max(0.0, min(wake) - time.perf_counter()), 0.005))
