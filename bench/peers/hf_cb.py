"""``--peer hf-cb``: transformers' own continuous batching (the manager behind
``generate_batch``), fed request by request at the workload's arrival times.

Each request gets its own ``max_new_tokens`` and ``eos_token_id=-1`` (no EOS,
i.e. ignore_eos), and ``record_timestamps=True`` gives a perf_counter time per
generated token. Occupancy is counted client-side from those timestamps.
"""

from __future__ import annotations

import time

from bench.metrics import RequestRecord, RunResult, occupancy_from_records
from bench.workloads import BenchRequest


def _manager_cm(model, requests: list[BenchRequest], prompt_ids: dict[str, list[int]], max_batch_size: int):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    longest = max(r.output_tokens for r in requests)
    gen = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(max_requests_per_batch=max_batch_size)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompt_ids.values()),
                          max_generated_length=longest, num_requests=len(requests))
    return model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                     block=True, timeout=30, workload_hints=hints)


def run(model, prompt_ids: dict[str, list[int]], requests: list[BenchRequest], max_batch_size: int,
        dtype: str) -> RunResult:
    """Serve ``requests`` with transformers' continuous batching; ``prompt_ids`` maps id to token ids."""
    results = {}
    with _manager_cm(model, requests, prompt_ids, max_batch_size) as manager:
        t0 = time.perf_counter()
        for r in requests:
            time.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            manager.add_request(prompt_ids[r.request_id], request_id=r.request_id, max_new_tokens=r.output_tokens,
                                record_timestamps=True, eos_token_id=-1)
        while len(results) < len(requests) and manager.is_running():
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
    records = [_record(r, results.get(r.request_id), t0) for r in requests]
    return RunResult("hf-cb", "continuous", records, occupancy_from_records(records), max_batch_size, dtype,
                     "running counted client-side from first to last token timestamps")


def _record(req: BenchRequest, out, t0: float) -> RequestRecord:
    record = RequestRecord(req.request_id, req.arrival_s, req.output_tokens)
    if out is None or out.error is not None:
        record.error = "missing" if out is None else str(out.error)
        return record
    record.token_times = [t - t0 for t in (out.timestamps or [])]
    record.output_tokens = len(out.generated_tokens)
    record.end_s = record.token_times[-1] if record.token_times else out.lifespan[1] - t0
    return record
