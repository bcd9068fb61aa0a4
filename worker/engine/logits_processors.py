"""The per-request logit controls applied before sampling, vectorized over a batch.

In this order, as vLLM applies them: ``logit_bias`` (OpenAI), ``min_tokens`` (EOS and
stop token ids masked until then), then the penalties: the repetition penalty over
prompt and output (Keskar et al. 2019, CTRL; transformers' and vLLM's definition)
and OpenAI's presence and frequency penalties over the output. Each control touches
only the rows that use it, with one batched tensor operation per control: no
per-row loop over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engine.sampling_params import SamplingParams


def apply_logit_controls(logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int],
                         prompt_ids: Sequence[Sequence[int]] | None = None,
                         output_ids: Sequence[Sequence[int]] | None = None,
                         eos_token_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """``logits`` with every row's controls applied.

    Args:
        logits: [B, V] float32, the model's raw logits (not modified).
        params: B sampling parameters.
        output_indices: B ints, tokens already in each row's output.
        prompt_ids / output_ids: B token-id lists, each row's prompt and output so far;
            needed only when some row has a penalty.
        eos_token_ids: the tokenizer's end-of-sequence ids (masked with min_tokens).

    Returns:
        [B, V] float32: ``logits`` itself when no row has a control, else a new tensor.

    Raises:
        ValueError: a row has a penalty but ``prompt_ids``/``output_ids`` are missing.
    """
    bias_rows = [r for r, p in enumerate(params) if p.logit_bias]
    ban_rows = [r for r, (p, i) in enumerate(zip(params, output_indices)) if i < p.min_tokens]
    penalty_rows = [r for r, p in enumerate(params) if p.penalizes]
    if not (bias_rows or ban_rows or penalty_rows):
        return logits
    out = logits.clone()
    if bias_rows:
        _add_bias(out, bias_rows, params)
    if ban_rows:
        _ban(out, ban_rows, params, eos_token_ids)
    if penalty_rows:
        if prompt_ids is None or output_ids is None:
            raise ValueError("penalties need each row's prompt and output token ids")
        _penalize(out, penalty_rows, params, prompt_ids, output_ids)
    return out


def _add_bias(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams]) -> None:
    index = [(r, t, b) for r in rows for t, b in params[r].logit_bias]
    r, t, b = zip(*index)
    dev = logits.device
    logits.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                      torch.tensor(b, dtype=logits.dtype, device=dev), accumulate=True)


def _ban(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams], eos: frozenset[int]) -> None:
    index = [(r, t) for r in rows for t in sorted(eos | set(params[r].stop_token_ids)) if t < logits.shape[1]]
    if index:
        r, t = zip(*index)
        logits[torch.tensor(r, device=logits.device), torch.tensor(t, device=logits.device)] = float("-inf")


def _token_table(ids: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, L] int64 token ids, [R, L] bool real-entry mask); a row shorter than L is
    padded with its own first id (``ids`` rows are non-empty), so a write that gives every
    occurrence of a token the same value stays right where padding repeats it."""
    width = max(len(x) for x in ids)
    table = torch.empty((len(ids), width), dtype=torch.int64)
    valid = torch.zeros((len(ids), width), dtype=torch.bool)
    for row, x in enumerate(ids):
        table[row] = x[0]
        table[row, : len(x)] = torch.as_tensor(x, dtype=torch.int64)
        valid[row, : len(x)] = True
    return table.to(device), valid.to(device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _penalize(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
              prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]]) -> None:
    """Penalties on the tokens each row has seen, in place: gathers and writes [R, L]
    entries (L = the longest history), never the whole [R, V] rows."""
    dev = logits.device
    rep_rows = [r for r in rows if params[r].repetition_penalty != 1 and (prompt_ids[r] or output_ids[r])]
    if rep_rows:
        table, _ = _token_table([list(prompt_ids[r]) + list(output_ids[r]) for r in rep_rows], dev)
        where = (torch.tensor(rep_rows, device=dev).unsqueeze(1), table)
        rep = _column([params[r].repetition_penalty for r in rep_rows], dev)
        seen = logits[where]
        logits[where] = torch.where(seen > 0, seen / rep, seen * rep)  # every copy of a token gets one value
    out_rows = [r for r in rows if (params[r].presence_penalty or params[r].frequency_penalty) and output_ids[r]]
    if out_rows:
        table, valid = _token_table([output_ids[r] for r in out_rows], dev)
        where = (torch.tensor(out_rows, device=dev).unsqueeze(1).expand_as(table), table)
        logits[where] = logits[where] - _column([params[r].presence_penalty for r in out_rows], dev)
        freq = _column([params[r].frequency_penalty for r in out_rows], dev) * valid  # once per occurrence
        logits.index_put_(where, -freq, accumulate=True)
