"""``--peer hf-generate``: Hugging Face transformers ``generate`` in static batches.

The classic request-level batcher: requests are grouped in arrival order into
batches of ``max_batch_size``; a batch starts when its last request has
arrived and the previous batch is done, and runs until its longest request is
done (every row decodes ``max(output_tokens)`` steps, EOS suppressed with
``min_new_tokens``). A row's tokens are timed at the decode step that produced
them (as a streaming server would send them), so TTFT and ITL are comparable
with streamed systems; its end is the step of its own last token.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.metrics import RequestRecord, RunResult
from bench.workloads import BenchRequest


def load_hf_model(gguf_path: Path, dtype: torch.dtype):
    """The GGUF model as a transformers model in ``dtype``.

    ``from_pretrained(dir, gguf_file=...)`` (transformers dequantizes) when
    ``accelerate`` is installed (transformers requires it for GGUF); else the
    config from the GGUF via ``AutoConfig`` and the weights dequantized by
    ``worker.model.loader.load_weights`` (HF names), loaded into ``from_config``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
    except ValueError as exc:
        if "accelerate" not in str(exc):
            raise
        model = _from_worker_weights(gguf_path, dtype, AutoConfig, AutoModelForCausalLM)
    return model.eval()


def _from_worker_weights(gguf_path: Path, dtype: torch.dtype, auto_config, auto_model):
    from worker.model.loader import load_weights

    config = auto_config.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = auto_model.from_config(config, dtype=dtype)
    _, weights = load_weights(gguf_path)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"GGUF weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


class _StepClock:
    """A stopping criterion that never stops: it timestamps every decode step (seconds, perf_counter)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _generate(model, rows: list[list[int]], steps: int) -> list[float]:
    """Run one static batch for ``steps`` new tokens; returns each step's perf_counter time."""
    from transformers import StoppingCriteriaList

    pad = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    pad = pad[0] if isinstance(pad, list) else pad
    ids, mask = _left_pad(rows, pad)
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=pad, stopping_criteria=StoppingCriteriaList([clock]))
    return clock.times


def run(model, prompt_ids: dict[str, list[int]], requests: list[BenchRequest], max_batch_size: int,
        dtype: str) -> RunResult:
    """Serve ``requests`` in static batches; ``prompt_ids`` maps request id to prompt token ids."""
    t0 = time.perf_counter()
    records, occupancy = [], [(0.0, 0)]
    for i in range(0, len(requests), max_batch_size):
        batch = requests[i:i + max_batch_size]
        wait = t0 + batch[-1].arrival_s - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        lengths = [r.output_tokens for r in batch]
        times = [t - t0 for t in _generate(model, [prompt_ids[r.request_id] for r in batch], max(lengths))]
        for r in batch:
            tt = times[:r.output_tokens]
            records.append(RequestRecord(r.request_id, r.arrival_s, r.output_tokens, tt, tt[-1], len(tt)))
        occupancy += [(t, sum(n > k for n in lengths)) for k, t in enumerate(times)] + [(times[-1], 0)]
    return RunResult("hf-generate", "static", records, occupancy, max_batch_size, dtype,
                     "running = rows of the batch still short of their own length, per decode step")
