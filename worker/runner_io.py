"""The typed hand-off between the scheduler/engine and the model runner.

The engine turns a scheduler decision into a :class:`ModelInput`; the model
runner executes it and hands back a :class:`ModelOutput`. Nothing else crosses
that boundary (no Sequence objects, no scheduler state).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledChunk:
    """The tokens of one sequence to run through the model in this step.

    Attributes:
        seq_id: engine-unique sequence id.
        token_ids: tokens to feed now: a prefill chunk (1..n tokens of prompt,
            or prompt + already generated tokens after preemption) or, for a
            decode, exactly the one last sampled token.
        start_pos: number of this sequence's tokens already in the KV cache;
            the chunk occupies positions ``start_pos .. start_pos+len-1``.
        block_table: physical KV block ids covering at least
            ``start_pos + len(token_ids)`` positions, in order.
        needs_logits: True when the step must return logits for the chunk's
            last token (decode, or the final chunk of a prefill).
        num_draft_tokens: speculative decoding: the chunk is the last sampled
            token followed by this many draft tokens, and the step returns
            logits for each of its last ``1 + num_draft_tokens`` tokens (the
            verification rows, :mod:`worker.engine.rejection_sampler`). 0 otherwise.
        lora_id: the LoRA adapter the chunk's tokens run with (the id the engine gave it
            when it was loaded into the runner, ``runner.add_lora``); 0 = the base model.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    needs_logits: bool = True
    num_draft_tokens: int = 0
    lora_id: int = 0

    @property
    def num_logits(self) -> int:
        """Logits rows this chunk returns: 0, 1, or ``1 + num_draft_tokens``."""
        return 1 + self.num_draft_tokens if self.needs_logits else 0


@dataclass(frozen=True)
class ModelInput:
    """One engine step's work. Prefill chunks (and speculative verification
    chunks, which carry several tokens) come first, then single-token decodes;
    the runner returns logits in that same order, ``num_logits`` rows per chunk.

    ``blocks_to_copy``: copy-on-write ``(src, dst)`` KV block pairs (vLLM's name): the
    runner copies block ``src``'s keys and values to ``dst`` in every layer, in order,
    before the forward pass writes anything."""

    prefills: list[ScheduledChunk] = field(default_factory=list)
    decodes: list[ScheduledChunk] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Total tokens fed to the model this step (the token budget's unit)."""
        return sum(len(c.token_ids) for c in self.prefills) + len(self.decodes)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Prefills then decodes, the order of the returned logits rows."""
        return [*self.prefills, *self.decodes]


@dataclass(frozen=True)
class ModelOutput:
    """Logits for every chunk with needs_logits, in ModelInput.chunks order
    (``num_logits`` consecutive rows for a verification chunk).

    Attributes:
        seq_ids: sequence id of each logits row.
        logits: torch.Tensor [len(seq_ids), vocab_size], float32, on the CPU or
            the runner's device.
    """

    seq_ids: list[int]
    logits: "object"  # torch.Tensor; typed loosely so this module needs no torch import
