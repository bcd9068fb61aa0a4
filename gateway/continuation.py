"""Continuations: the gateway's answer to "worker dies after XACK" (DESIGN.md).

Once a worker has acknowledged a queue entry, Redis no longer holds it: the
gateway owns the request. When the worker's link drops (crash, SIGKILL, or a
drain whose grace period ran out), every request that link carried is put
back on the queue as a *continuation*: the same request id, prompt and
sampling parameters, plus the output tokens and text its client already
received. The next worker re-prefills prompt + those tokens, counts them
against ``max_tokens``, continues seeded sampling at their index
(``worker.engine.sampler.seed_for_step``) and emits only what comes after, so the
client's stream goes on with nothing repeated or lost.

A continuation carries one choice: the worker refuses one with ``n`` > 1 and resumed
tokens. A request with n > 1 choices is therefore re-queued whole only while none
of its choices has delivered a token (or finished); after that its client gets
UNAVAILABLE (503) saying so, instead of choices that restart or repeat.

Each continuation has a new ``attempt`` number; the request table accepts only
the attempt it expects, so a stale copy (the original entry reclaimed from a dead
worker's pending list) can never run beside it. Like vLLM's recompute
preemption, resuming costs one prefill of prompt + output.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from gateway.errors import DeadlineExceededError, InflightError, UnavailableError
from gateway.metrics import GatewayMetrics
from gateway.queue import RequestQueue
from gateway.request_table import PendingRequest, RequestTable
from protos import queue_pb2

log = logging.getLogger(__name__)


def build_continuation(original: queue_pb2.QueuedRequest, delivered_token_ids: list[int],
                       delivered_text: str, attempt: int, now_unix_s: float) -> queue_pb2.QueuedRequest:
    """The queue entry that resumes ``original`` after ``delivered_token_ids``.

    Args:
        original: the request as first queued (prompt, sampling, deadline, reply_to).
        delivered_token_ids: every output token id the client received, in order.
        delivered_text: the concatenated text the client received.
        attempt: the continuation's number (1 = first continuation).
        now_unix_s: wall-clock seconds, the continuation's enqueue time.

    Returns:
        A copy of ``original`` with ``resumed_token_ids``, ``resumed_text``,
        ``attempt`` and ``enqueued_unix_s`` set; the deadline is unchanged.
    """
    cont = queue_pb2.QueuedRequest()
    cont.CopyFrom(original)
    del cont.resumed_token_ids[:]
    cont.resumed_token_ids.extend(delivered_token_ids)
    cont.resumed_text = delivered_text
    cont.attempt = attempt
    cont.enqueued_unix_s = now_unix_s
    return cont


@dataclass
class ContinuationPolicy:
    """A :class:`gateway.request_table.RequestTable` link-loss policy that re-enqueues continuations.

    Args:
        queue: where continuations are XADDed.
        metrics: ``inflight_gateway_continuations_total{outcome}`` is counted here.
        max_attempts: continuations per request before the client gets UNAVAILABLE
            instead (a request that kills every worker must not loop forever).
    """

    queue: RequestQueue
    metrics: GatewayMetrics
    max_attempts: int = 3
    request_table: RequestTable | None = None

    async def __call__(self, pending: PendingRequest) -> None:
        """Link-loss policy: :meth:`requeue` ``pending`` as a continuation."""
        await self.requeue(pending, "resumed")

    async def requeue(self, pending: PendingRequest, outcome: str) -> None:
        """Re-enqueue ``pending`` under a new attempt with what its client already has,
        or end it with a clear error (UNAVAILABLE: no original message, attempts
        exhausted, Redis down; DEADLINE_EXCEEDED: its deadline passed).

        A journaled stream whose owner lease another gateway took over (``pending.owned``)
        is not re-queued: its client gets UNAVAILABLE ``stream_taken_over``.

        Args:
            outcome: the metric label and log word for a successful re-enqueue
                ("resumed" after link loss, "requeued" for a vanished queue entry).
        """
        assert self.request_table is not None, "bind the policy to its request table first"
        original = pending.message
        error = self._refusal(pending)
        if error is not None:
            self.metrics.continuations.labels(outcome=error.kind).inc()
            pending.events.put_nowait(error)
            return
        assert original is not None
        if pending.owned is not None and not await pending.owned():
            self.metrics.continuations.labels(outcome="taken_over").inc()
            pending.events.put_nowait(UnavailableError(
                f"stream {pending.request_id} was resumed on another connection, which now delivers it; "
                "this one ends", code="stream_taken_over"))
            return
        old_ticket, attempt = pending.ticket, pending.attempt + 1
        cont = build_continuation(original, pending.delivered_token_ids, "".join(pending.delivered_text),
                                  attempt, time.time())
        self.request_table.readmit(pending, attempt)  # before the XADD: a fast worker may accept at once
        if pending.trace is not None:  # tracing: the same trace, a new queue span
            pending.trace.continuation(attempt, outcome, len(cont.resumed_token_ids))
        try:
            ticket = await self.queue.enqueue(cont)
        except InflightError as exc:
            self.metrics.continuations.labels(outcome="unavailable").inc()
            self.request_table.fail(pending.request_id, UnavailableError(
                f"the worker running request {pending.request_id} disconnected and it could not be "
                f"re-queued ({exc.message}); retry the request"))
            return
        if pending.ticket is None and pending.attempt == attempt:
            pending.ticket = ticket
        self.metrics.continuations.labels(outcome=outcome).inc()
        log.info("continuation queued", extra={"request_id": pending.request_id, "attempt": attempt,
                                               "resumed_tokens": len(cont.resumed_token_ids),
                                               "why": outcome})
        if old_ticket is not None:
            await self.queue.retire(old_ticket)

    def _refusal(self, pending: PendingRequest) -> InflightError | None:
        """Why ``pending`` cannot be continued, or None."""
        rid, original = pending.request_id, pending.message
        attempts = pending.attempt - pending.resumed_attempt
        if original is None or attempts >= self.max_attempts:
            return UnavailableError(f"the worker running request {rid} disconnected "
                                    f"{attempts + 1} time(s); retry the request")
        if original.deadline_unix_s and time.time() >= original.deadline_unix_s:
            return DeadlineExceededError("the request did not finish before its deadline")
        if pending.choices > 1 and (pending.delivered_token_ids or pending.finished_choices):
            return UnavailableError(
                f"the worker running request {rid} disconnected after it had delivered tokens; a "
                f"request with n={pending.choices} choices cannot be resumed part way; retry the "
                "request", code="not_resumable")
        if len(pending.delivered_token_ids) >= original.sampling.max_tokens:
            return UnavailableError(f"the worker running request {rid} disconnected after its last "
                                    "token; retry the request")
        return None
