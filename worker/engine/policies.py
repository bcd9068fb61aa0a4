"""Waiting-queue orders: ``fcfs``, ``sjf`` (with aging) and ``fair`` (deficit round
robin over tenants). They only order the candidates; whether a request can start,
must wait or can never run is the scheduler's one admission answer
(:meth:`worker.engine.scheduler.Scheduler.admission`).

Every policy orders waiting work first by request priority (0 = highest),
then preempted before fresh sequences (they hold generated tokens and were
admitted before anyone waiting), then by its own key. The scheduler keeps
``waiting`` sorted by :meth:`Policy.key` and admits from
:meth:`Policy.candidates`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import groupby

from worker.engine.engine_config import EngineConfig
from worker.engine.sequence import Sequence, SequenceStatus


def _class(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, 0 if seq.status is SequenceStatus.PREEMPTED else 1)


def expected_cost(seq: Sequence) -> int:
    """Expected work of a request in tokens: prompt + max_tokens."""
    return seq.num_prompt_tokens + seq.params.max_tokens


class Policy:
    """First come, first served (arrival time, then engine order)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def order(self, seq: Sequence) -> tuple:
        """The policy's own sort key (smaller first)."""
        return (seq.arrival_time, seq.seq_id)

    def key(self, seq: Sequence) -> tuple:
        """Full waiting-queue key: priority, preempted first, then :meth:`order`.
        Must not change while ``seq`` waits (the queue is kept sorted)."""
        return (*_class(seq), *self.order(seq))

    def candidates(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        """Waiting sequences in admission order (``waiting`` is sorted by
        :meth:`key`; the caller may stop early)."""
        return iter(list(waiting))

    def admitted(self, seq: Sequence) -> None:
        """Called when a candidate was admitted (no-op here)."""


class SjfPolicy(Policy):
    """Shortest expected work first with aging.

    The effective cost of a request that has waited ``w`` seconds is
    ``cost - rate * w`` (cost = prompt + max_tokens tokens, rate =
    ``sjf_aging_tokens_per_s``). Since ``w = now - arrival``, ordering by it
    equals ordering by ``cost + rate * arrival``, a key that never changes.
    Bound: a request of cost C is overtaken by no request arriving more than
    ``C / rate`` seconds after it, so nothing waits forever (rate > 0).
    """

    def order(self, seq: Sequence) -> tuple:
        """``cost + rate * arrival`` (tokens), then engine order."""
        return (expected_cost(seq) + self.config.sjf_aging_tokens_per_s * seq.arrival_time, seq.seq_id)


class FairPolicy(Policy):
    """Per-tenant fair share of admissions, by deficit round robin
    (Shreedhar & Varghese, "Efficient fair queueing using deficit round
    robin", SIGCOMM'95).

    Tenants with waiting work sit in a round-robin ring that persists across
    steps. On each visit a tenant gains ``fair_quantum_tokens`` of credit and
    admits its oldest requests while their cost (tokens of their first
    chunk) fits the credit; a tenant with nothing waiting loses its credit.
    A flooding tenant therefore gets no more admission tokens per round than
    a light one. Priority and preempted classes are served in order, DRR
    within each.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.deficit: dict[str, float] = {}
        self._ring: deque[str] = deque()
        self._granted = False  # the ring head already got its quantum this visit

    def cost(self, seq: Sequence) -> int:
        """Admission cost in tokens: the first chunk (capped by the step budget and
        the long-prefill threshold)."""
        return max(1, min(seq.num_uncomputed_tokens, self.config.prefill_chunk_cap))

    def candidates(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        """DRR order over tenants within each (priority, preempted) class."""
        for _, group in groupby(list(waiting), key=_class):
            queues: dict[str, deque[Sequence]] = {}
            for seq in group:
                queues.setdefault(seq.tenant, deque()).append(seq)
            yield from self._round_robin(queues)

    def _round_robin(self, queues: dict[str, deque[Sequence]]) -> Iterator[Sequence]:
        self._sync(queues)
        while any(queues.values()):
            tenant = self._ring[0]
            queue = queues.get(tenant)
            if not self._granted:
                self.deficit[tenant] = self.deficit.get(tenant, 0.0) + self.config.fair_quantum_tokens
                self._granted = True
            if queue and self.cost(queue[0]) <= self.deficit[tenant]:
                yield queue.popleft()
            else:
                self._ring.rotate(-1)
                self._granted = False

    def _sync(self, queues: dict[str, deque[Sequence]]) -> None:
        for tenant in [t for t in self._ring if t not in queues]:
            if tenant == self._ring[0]:
                self._granted = False
            self._ring.remove(tenant)  # an idle tenant leaves the ring and loses its credit
            self.deficit.pop(tenant, None)
        self._ring.extend(t for t in queues if t not in self.deficit)
        for t in queues:
            self.deficit.setdefault(t, 0.0)

    def admitted(self, seq: Sequence) -> None:
        """Charge the tenant the request's admission cost (tokens)."""
        self.deficit[seq.tenant] = self.deficit.get(seq.tenant, 0.0) - self.cost(seq)


POLICIES: dict[str, type[Policy]] = {"fcfs": Policy, "sjf": SjfPolicy, "fair": FairPolicy}


def make_policy(config: EngineConfig) -> Policy:
    """The policy object named by ``config.policy``."""
    return POLICIES[config.policy](config)
