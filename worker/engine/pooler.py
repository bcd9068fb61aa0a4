"""Pooling of a prompt's hidden states into one embedding (vLLM's ``--pooler-config``).

A pooling worker (``--runner pooling``, worker/engine/pooling_engine.py) runs each prompt
through the model once and keeps, per prompt, the final-norm hidden states that its pooling
type reads: ``LAST`` the last token's (decoder embedding models such as Qwen3-Embedding, the
default), ``MEAN`` the average over every prompt token, ``CLS`` the first token's. The pooled
vector is then cut to the request's ``dimensions`` (Matryoshka) and L2-normalized when both the
pooler config and the request ask for it (:func:`finish_embedding`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling worker turns hidden states into an embedding (vLLM's ``PoolerConfig``).

    Attributes:
        pooling_type: "LAST" (last prompt token), "MEAN" (average over the prompt's tokens)
            or "CLS" (first token).
        normalize: L2-normalize the (truncated) vector; off, a request's ``normalize`` cannot
            turn it on (the model's raw pooled states are served).
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def from_json(cls, text: str | None) -> PoolerConfig:
        """The config of ``--pooler-config`` (vLLM's JSON: ``{"pooling_type": "MEAN",
        "normalize": true}``; ``pooling_type`` case-insensitive); empty or None = defaults.

        Raises:
            ValueError: not a JSON object, an unknown key, or a bad value (the message names it).
        """
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--pooler-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--pooler-config must be a JSON object")
        unknown = sorted(set(raw) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"--pooler-config: unsupported key(s) {', '.join(unknown)} "
                             "(supported: pooling_type, normalize)")
        kind = raw.get("pooling_type", cls.pooling_type)
        if not isinstance(kind, str):
            raise ValueError(f"--pooler-config: pooling_type must be a string, got {kind!r}")
        try:
            return cls(pooling_type=kind.upper(), normalize=raw.get("normalize", cls.normalize))
        except ValueError as exc:
            raise ValueError(f"--pooler-config: {exc}") from None

    def rows(self, start: int, end: int, prompt_len: int) -> range:
        """The positions in ``[start, end)`` of a prompt of ``prompt_len`` tokens whose hidden
        states this pooling reads (a chunk of the prompt runs positions ``start..end-1``)."""
        if self.pooling_type == "MEAN":
            return range(start, end)
        wanted = prompt_len - 1 if self.pooling_type == "LAST" else 0
        return range(wanted, wanted + 1) if start <= wanted < end else range(0)


class PooledState:
    """One prompt's pooling in progress, fed chunk by chunk (a long prompt is prefilled over
    several steps): the sum of the rows read (MEAN) or the one row (LAST, CLS), float32."""

    def __init__(self, config: PoolerConfig, prompt_len: int):
        self.config = config
        self.prompt_len = prompt_len
        self._sum: torch.Tensor | None = None
        self._rows = 0

    def add(self, hidden: torch.Tensor) -> None:
        """Fold ``hidden`` ``[rows, hidden_size]`` float32 (rows this pooling reads) in."""
        if hidden.shape[0] == 0:
            return
        part = hidden.float().sum(dim=0)
        self._sum = part if self._sum is None else self._sum + part
        self._rows += hidden.shape[0]

    def pooled(self) -> torch.Tensor:
        """``[hidden_size]`` float32: the mean of the rows read (one row: that row).

        Raises:
            RuntimeError: no row was read yet.
        """
        if self._sum is None:
            raise RuntimeError("no hidden state was pooled")
        return self._sum / self._rows


def finish_embedding(pooled: torch.Tensor, dimensions: int, normalize: bool) -> list[float]:
    """The served embedding of a pooled ``[hidden_size]`` vector: its first ``dimensions``
    values (0 = all; Matryoshka truncation, before normalizing, as vLLM), L2-normalized when
    ``normalize``; float32 values as a Python list.

    Raises:
        ValueError: ``dimensions`` above the vector's size.
    """
    size = pooled.shape[-1]
    if dimensions > size:
        raise ValueError(f"dimensions {dimensions} is above the model's embedding size {size}")
    vec = pooled.float().cpu()
    if dimensions:
        vec = vec[:dimensions]
    if normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=-1)
    return vec.tolist()
