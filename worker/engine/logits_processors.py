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


def _token_table(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, L] int64 token ids, each row padded with ``vocab`` (a column past the vocabulary)."""
    width = max(1, max(len(x) for x in ids))
    table = torch.full((len(ids), width), vocab, dtype=torch.int64)
    for row, x in enumerate(ids):
        if x:
            table[row, : len(x)] = torch.as_tensor(x, dtype=torch.int64)
    return table.to(device)


def _counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32: how often each token occurs in each row's ``ids``."""
    table = _token_table(ids, vocab, device)
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, table, torch.ones_like(table, dtype=torch.float32))
    return counts[:, :vocab]


def _penalize(logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
              prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]]) -> None:
    vocab, dev = logits.shape[1], logits.device
    sub = logits[torch.tensor(rows, device=dev)]
    out_counts = _counts([output_ids[r] for r in rows], vocab, dev)
    rep = torch.tensor([params[r].repetition_penalty for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    if (rep != 1).any():
        seen = (_counts([prompt_ids[r] for r in rows], vocab, dev) + out_counts) > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([params[r].frequency_penalty for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    pres = torch.tensor([params[r].presence_penalty for r in rows], dtype=torch.float32, device=dev).unsqueeze(1)
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    logits[torch.tensor(rows, device=dev)] = sub
