"""The batched LoRA product of one step: rows of several adapters and base rows share one
forward pass (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023).

Every row (token) of the step has an adapter slot: ``-1`` for the base model, else the index
of its adapter among the step's distinct adapters. For each fused projection the adapters'
stacked ``A`` are concatenated along the rank axis (``a_t`` ``[in, R_total]``) and so are
their ``B`` (``b_t`` ``[R_total, out]``, the scaling folded in); a row mask ``[rows, R_total]``
keeps, for each row, only its own adapter's columns. Then::

    out += ((x @ a_t) * mask) @ b_t

is two GEMMs per projection whatever the number of adapters: each adapter's weights are read
once per step, as the base weights are (a decode step is bound by reading weights); the shrink
``x @ a_t`` computes every adapter's columns for every row, which costs
``rows × in × R_total`` multiply-adds, small beside the base projection. A base row's mask
row is zero, so its output gets exactly ``+ 0``: its bits are the base model's.

The concatenation is kept while the step's set of adapters stays the same
(:class:`LoraStacks`), so a steady mix of adapters is stacked once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.lora import PROJECTIONS, LoraAdapter


@dataclass(frozen=True)
class LoraBatch:
    """One step's LoRA, handed to :meth:`worker.model.llama.LlamaDecoder.forward`.

    Attributes:
        layers: per decoder layer, projection name → ``(a_t [in, R_total], b_t [R_total, out])``
            in the compute dtype (absent: no adapter of the step adapts that projection).
        masks: per projection name, ``[num_tokens, R_total]`` in the compute dtype: 1 where the
            column belongs to the row's adapter, else 0.
    """

    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    masks: dict[str, torch.Tensor]

    def apply(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``[num_tokens, out]``, the base projection of ``x`` ``[num_tokens, in]``) plus
        each row's adapter delta, added in place; ``out`` returned."""
        pair = self.layers[layer].get(projection)
        if pair is None:
            return out
        a_t, b_t = pair
        shrink = torch.mm(x, a_t).mul_(self.masks[projection])
        return out.addmm_(shrink, b_t)


class LoraStacks:
    """The stacked weights of the last set of adapters a step used (rebuilt when it changes)."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []

    def clear(self) -> None:
        """Forget the stacks (an adapter was removed or replaced)."""
        self._key, self._layers = None, []

    def batch(self, adapters: list[LoraAdapter], row_slots: torch.Tensor) -> LoraBatch:
        """The :class:`LoraBatch` of a step whose rows use ``adapters`` (``row_slots``
        ``[num_tokens]`` int64: the index into ``adapters``, -1 for base rows)."""
        key = tuple(id(a) for a in adapters)
        if key != self._key:
            self._layers = _stack(adapters)
            self._key = key
        first = self._layers and next((p for layer in self._layers for p in layer.values()), None)
        dtype = first[0].dtype if first else torch.float32
        masks = {}
        for proj in PROJECTIONS:
            owners = torch.cat([torch.full((a.widths[proj],), slot, dtype=torch.int64)
                                for slot, a in enumerate(adapters)])
            if owners.numel():
                masks[proj] = (row_slots[:, None] == owners[None, :].to(row_slots.device)).to(dtype)
        return LoraBatch(self._layers, masks)


def _stack(adapters: list[LoraAdapter]) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer and projection, the adapters' ``a_t`` and ``b_t`` concatenated along the rank
    axis, in ``adapters`` order."""
    layers = []
    for i in range(len(adapters[0].layers)):
        stacked = {}
        for proj in PROJECTIONS:
            pairs = [a.layers[i][proj] for a in adapters if a.widths[proj]]
            if pairs:
                stacked[proj] = (torch.cat([p.a_t for p in pairs], dim=1).contiguous(),
                                 torch.cat([p.b_t for p in pairs], dim=0).contiguous())
        layers.append(stacked)
    return layers
