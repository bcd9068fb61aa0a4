"""A request inside the engine: its tokens, progress and lifecycle state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from worker.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence; changed only by :meth:`Sequence.set_status`.

    WAITING → RUNNING → (PREEMPTED → RUNNING)* → FINISHED_*. PREEMPTED is a
    waiting state: the sequence lost its KV blocks (recompute preemption) and
    sits at the front of the waiting queue, its generated tokens kept.
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"


#: The one table from end states to OpenAI-style finish reasons.
FINISH_REASONS: dict[SequenceStatus, str] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}

#: Most tokens decoded without drafts after failed verifications (Sequence.record_verification).
MAX_SPEC_BACKOFF = 16

_WAITING_STATES = frozenset({SequenceStatus.WAITING, SequenceStatus.PREEMPTED})
_ALLOWED: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    SequenceStatus.WAITING: frozenset({SequenceStatus.RUNNING, *FINISH_REASONS}),
    SequenceStatus.PREEMPTED: frozenset({SequenceStatus.RUNNING, *FINISH_REASONS}),
    SequenceStatus.RUNNING: frozenset({SequenceStatus.PREEMPTED, *FINISH_REASONS}),
}


@dataclass(eq=False)
class Sequence:
    """One request's token sequence (a single sample; no beam search).

    Attributes:
        seq_id: engine-unique id (the runner and block manager key).
        request_id: the caller's id.
        prompt_token_ids: prompt tokens.
        params: sampling parameters.
        arrival_time: seconds (the scheduler's clock) when it was added.
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens whose KV is in the cache (reset to 0 by
            preemption; the sequence then re-prefills prompt + output).
        status: see :class:`SequenceStatus`.
        num_preemptions: times this sequence was preempted.
        tenant: owner, for the "fair" policy.
        priority: 0 = highest; ordered first by every policy and preempted
            last.
        num_cached_prompt_tokens: prompt tokens served from the prefix cache
            at first admission.
        num_resumed_tokens: leading output tokens generated elsewhere (a
            continuation); they are context, never emitted again.
        index: which of the request's ``n`` choices this is (0-based).
        spec_misses: speculative decoding: verifications in a row that accepted no
            draft token (see :meth:`record_verification`).
        spec_resume_at: no drafts are proposed before the output has this many tokens.
        lora_id: the LoRA adapter it runs with (the runner's id; 0 = the base model).
        lora_salt: that adapter's identity in block hashes ("" = the base model;
            :func:`common.block_hash.adapter_salt`), so no KV block is shared across adapters.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    tenant: str = ""
    priority: int = 1
    num_cached_prompt_tokens: int = 0
    num_resumed_tokens: int = 0
    index: int = 0
    spec_misses: int = 0
    spec_resume_at: int = 0
    lora_id: int = 0
    lora_salt: str = ""

    def record_verification(self, num_accepted: int) -> None:
        """Back off from drafting where drafts keep failing: after ``m`` verifications
        in a row that accepted nothing, the next ``2**m - 1`` tokens (at most
        :data:`MAX_SPEC_BACKOFF`) are decoded without drafts; one accepted draft
        resets it. A failed verification costs more than a plain decode step on the
        CPU (bench/RESULTS.md run 21), so text that does not copy its
        context stops paying for it, and text that does is back within a few tokens."""
        self.spec_misses = 0 if num_accepted else self.spec_misses + 1
        self.spec_resume_at = self.num_output_tokens + min(MAX_SPEC_BACKOFF, 2 ** self.spec_misses - 1)

    def set_status(self, new: SequenceStatus) -> None:
        """The one place the status changes.

        Raises:
            ValueError: on a transition the lifecycle does not allow.
        """
        if new not in _ALLOWED.get(self.status, frozenset()):
            raise ValueError(f"sequence {self.seq_id}: illegal transition {self.status.name} -> {new.name}")
        if new is SequenceStatus.PREEMPTED:
            self.num_computed_tokens = 0
            self.num_preemptions += 1
        self.status = new

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed to the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """True when the next chunk is one decode token (prefill done)."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def token_ids(self) -> list[int]:
        """Prompt + generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - p) : end - p]

    @property
    def is_waiting(self) -> bool:
        """True while queued (WAITING or PREEMPTED)."""
        return self.status in _WAITING_STATES

    @property
    def is_finished(self) -> bool:
        """True in any FINISHED_* state."""
        return self.status in FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" | "error", or None while unfinished."""
        return FINISH_REASONS.get(self.status)
