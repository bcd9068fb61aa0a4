"""The batched LoRA product of one step: rows of several adapters and base rows share one
forward pass (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023).

Every row (token) of the step has an adapter slot: ``-1`` for the base model, else the index
of its adapter among the step's distinct adapters. For each fused projection (qkv, o, gate_up,
down) the ``A`` of every adapted module of every adapter of the step are concatenated along the
rank axis, module by module (``a_t`` ``[in, R_total]``: q's columns of each adapter, then k's,
then v's), and a row mask ``[rows, R_total]`` keeps, for each row, only its own adapter's
columns. Then::

    shrink = (x @ a_t) * mask                                  # one GEMM per projection
    out[:, module's outputs] += shrink[:, module's columns] @ b_t_module   # one per module

so each adapter's weights are read once per step, as the base weights are (a decode step is
bound by reading weights), and no zeros are multiplied for the modules of a fused projection
(each module's ``B`` writes only its own output columns). The shrink computes every adapter's
columns for every row (``rows × in × R_total`` multiply-adds, small beside the base
projection); the mask zeroes the others. A base row's mask row is zero, so its output gets
exactly ``+ 0``: its bits are the base model's.

On the CPU the product runs grouped by adapter instead
(``inflight_kernels.lora_apply``, ``inflight_kernels/cpu/lora_gemm.cpp``: Punica's SGMV
shape): each row computes only its own adapter's columns (its *pieces*: one per adapted module,
a slice of ``a_t``'s columns and of the module's ``B`` rows), so a step with 4 adapters does a
quarter of the masked product's multiply-adds, in one call per projection, in float32 (a
bfloat16 step's deltas are summed in float32 and added with one rounding). Base rows are left
untouched there too. CUDA keeps the masked product above.

The concatenation is kept while the step's set of adapters stays the same
(:class:`LoraStacks`), so a steady mix of adapters is stacked once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import inflight_kernels
from worker.model.lora import PROJECTIONS, LoraAdapter, module_slices
from worker.model.model_config import ModelConfig


@dataclass(frozen=True)
class LoraSegment:
    """One module's expand within a fused projection.

    Attributes:
        out_start, out_end: its output columns in the fused projection's output.
        col_start, col_end: its columns of the projection's shrink ``[rows, R_total]``.
        b_t: ``[col_end - col_start, out_end - out_start]``: the step's adapters' scaled ``B``
            of this module, stacked in the shrink's column order.
    """

    out_start: int
    out_end: int
    col_start: int
    col_end: int
    b_t: torch.Tensor


@dataclass(frozen=True)
class LoraStack:
    """One fused projection's LoRA in one layer for one set of adapters.

    Attributes:
        a_t: ``[in, R_total]`` every adapted module's ``A`` of every adapter, module by module.
        segments: each module's expand.
        pieces: int64 ``[P, 5]``, one row per adapted module of one adapter (slot, out_start,
            out_end, col_start, col_end): the grouped product's view of the same weights.
        piece_b: per piece, its rows of the module's ``B`` (a view of the segment's ``b_t``), in
            float32 (a float32 copy when the compute dtype is another: the kernel's dtype).
        a_t32: ``a_t`` in float32 (``a_t`` itself when that is its dtype), for the kernel.
    """

    a_t: torch.Tensor
    segments: tuple[LoraSegment, ...]
    pieces: torch.Tensor
    piece_b: tuple[torch.Tensor, ...]
    a_t32: torch.Tensor


@dataclass(frozen=True)
class LoraBatch:
    """One step's LoRA, handed to :meth:`worker.model.llama.LlamaDecoder.forward`.

    Attributes:
        layers: per decoder layer, projection name → :class:`LoraStack` (absent: no adapter of
            the step adapts that projection), in the compute dtype.
        masks: per projection name, ``[num_tokens, R_total]`` in the compute dtype: 1 where the
            column belongs to the row's adapter, else 0 (empty when ``row_slots`` is used instead).
        row_slots: int64 ``[num_tokens]``, each row's adapter slot (-1: base), for the grouped
            product; None: the masked product.
    """

    layers: list[dict[str, LoraStack]]
    masks: dict[str, torch.Tensor]
    row_slots: torch.Tensor | None = None

    def apply(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (``[num_tokens, out]``, the base projection of ``x`` ``[num_tokens, in]``) plus
        each row's adapter delta, added in place; ``out`` returned."""
        stack = self.layers[layer].get(projection)
        if stack is None:
            return out
        if self.row_slots is not None:
            x32 = x.float()
            x32 = x32 if x32.stride(-1) == 1 else x32.contiguous()
            if out.dtype == torch.float32 and out.stride(-1) == 1:
                return inflight_kernels.lora_apply(out, x32, self.row_slots, stack.a_t32, stack.pieces,
                                                   list(stack.piece_b))
            # bfloat16 (or strided) output: the deltas in float32, added with one rounding (a base
            # row's delta is 0, so its values stay the base model's)
            delta = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
            inflight_kernels.lora_apply(delta, x32, self.row_slots, stack.a_t32, stack.pieces, list(stack.piece_b))
            return out.add_(delta)
        shrink = torch.mm(x, stack.a_t).mul_(self.masks[projection])
        for seg in stack.segments:
            out[:, seg.out_start:seg.out_end].addmm_(shrink[:, seg.col_start:seg.col_end], seg.b_t)
        return out


class LoraStacks:
    """The stacked weights of the last set of adapters a step used (rebuilt when it changes),
    for a model of ``config``."""

    def __init__(self, config: ModelConfig) -> None:
        self.slices = module_slices(config)
        #: Use the grouped product where it runs compiled (False: always the masked one; the
        #: bench's comparison of the two).
        self.grouped = True
        self._key: tuple[int, ...] | None = None
        self._layers: list[dict[str, LoraStack]] = []
        self._owners: dict[str, torch.Tensor] = {}

    def clear(self) -> None:
        """Forget the stacks (an adapter was removed or replaced)."""
        self._key, self._layers, self._owners = None, [], {}

    def batch(self, adapters: list[LoraAdapter], row_slots: torch.Tensor) -> LoraBatch:
        """The :class:`LoraBatch` of a step whose rows use ``adapters`` (``row_slots``
        ``[num_tokens]`` int64: the index into ``adapters``, -1 for base rows)."""
        key = tuple(id(a) for a in adapters)
        if key != self._key:
            self._layers, self._owners = self._stack(adapters)
            self._key = key
        weights = next((s.a_t32 for layer in self._layers for s in layer.values()), None)
        dtype = next((s.a_t.dtype for layer in self._layers for s in layer.values()), torch.float32)
        if self.grouped and weights is not None and inflight_kernels.lora_kernel(weights):
            return LoraBatch(self._layers, {}, row_slots.to(torch.int64).contiguous())
        masks = {proj: (row_slots[:, None] == owners[None, :].to(row_slots.device)).to(dtype)
                 for proj, owners in self._owners.items()}
        return LoraBatch(self._layers, masks)

    def _stack(self, adapters: list[LoraAdapter]) -> tuple[list[dict[str, LoraStack]], dict[str, torch.Tensor]]:
        """Per layer and projection the :class:`LoraStack` of ``adapters``, and per projection the
        slot owning each shrink column."""
        plan: dict[str, list[tuple[str, list[int]]]] = {}  # projection -> [(module, slots adapting it)]
        for module, (proj, *_rest) in self.slices.items():
            slots = [k for k, a in enumerate(adapters) if module in a.modules]
            if slots:
                plan.setdefault(proj, []).append((module, slots))
        owners = {proj: torch.tensor([k for _, slots in mods for k in slots for _ in range(adapters[k].rank)],
                                     dtype=torch.int64) for proj, mods in plan.items()}
        layers = []
        for i in range(len(adapters[0].layers)):
            stacked = {}
            for proj in PROJECTIONS:
                if proj not in plan:
                    continue
                a_parts, segments, pieces, piece_b, col = [], [], [], [], 0
                for module, slots in plan[proj]:
                    _, out_start, out_end, _ = self.slices[module]
                    parts = [adapters[k].layers[i][module] for k in slots]
                    a_parts += [p.a_t for p in parts]
                    width = sum(p.a_t.shape[1] for p in parts)
                    b_t = torch.cat([p.b_t for p in parts], dim=0).contiguous()
                    segments.append(LoraSegment(out_start, out_end, col, col + width, b_t))
                    offset = 0
                    for k, part in zip(slots, parts):
                        rank = part.a_t.shape[1]
                        pieces.append((k, out_start, out_end, col + offset, col + offset + rank))
                        piece_b.append(b_t[offset:offset + rank].float())
                        offset += rank
                    col += width
                a_t = torch.cat(a_parts, dim=1).contiguous()
                stacked[proj] = LoraStack(a_t, tuple(segments), torch.tensor(pieces, dtype=torch.int64).reshape(-1, 5),
                                          tuple(piece_b), a_t.float())
            layers.append(stacked)
        return layers, owners
