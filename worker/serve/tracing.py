"""The worker's spans of the requests it runs (common/tracing.py says when tracing is on).

Per started queue entry (one attempt of a request) an ``inflight.worker.request``
span, a child of the gateway's request span named by ``QueuedRequest.traceparent``
(so every attempt, continuations included, joins the request's one trace), with
children ``inflight.prefill`` (added to the engine → its first token sampled here,
covering the wait for a batch slot, chunked prefill and, for a continuation, the
re-prefill of the resumed tokens) and ``inflight.decode`` (first token → finish).
Events on the request span: ``first_token``, ``preemption`` (recompute: it lost its
KV blocks and will re-prefill) and ``finish`` (reason and usage).

The timing comes from the serve layer only, the engine is not touched: the outputs
of each step, and the engine's preemption counter in ``EngineStats``; which requests
were preempted is read from the engine's last schedule (:func:`_preempted_ids`),
only when that counter moved.

Nothing here runs when tracing is off: ``WorkerService`` then holds None and skips
every hook, so no span is created.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from common.tracing import context_from_traceparent
from protos import queue_pb2
from worker.engine.engine_types import EngineStats, RequestOutput


@dataclass
class _Run:
    span: Any
    phase: Any  # the open prefill or decode span
    decoding: bool = False


class WorkerTracing:
    """Spans of the requests running on this worker.

    Args:
        tracer: an OpenTelemetry ``Tracer``.
        worker_id: set on every span (``inflight.worker_id``).
    """

    def __init__(self, tracer: Any, worker_id: str):
        self._tracer = tracer
        self._worker_id = worker_id
        self._runs: dict[str, _Run] = {}
        self._preemptions = 0

    def __len__(self) -> int:
        return len(self._runs)

    def started(self, req: queue_pb2.QueuedRequest, queue_time_s: float) -> None:
        """``req`` was just added to the engine."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        self.ended(req.request_id, "replaced")  # an older attempt of it ran here
        span = self._tracer.start_span(
            "inflight.worker.request", kind=SpanKind.CONSUMER, context=context_from_traceparent(req.traceparent),
            attributes={"gen_ai.request.id": req.request_id, "inflight.worker_id": self._worker_id,
                        "inflight.attempt": req.attempt, "inflight.resumed_tokens": len(req.resumed_token_ids),
                        "gen_ai.usage.prompt_tokens": len(req.prompt_token_ids),
                        "gen_ai.request.max_tokens": req.sampling.max_tokens,
                        "gen_ai.latency.time_in_queue": queue_time_s})
        phase = self._tracer.start_span("inflight.prefill", context=set_span_in_context(span))
        self._runs[req.request_id] = _Run(span, phase)

    def on_step(self, outputs: Iterable[RequestOutput], stats: EngineStats, engine: Any) -> None:
        """After each engine step: first tokens, finishes and preemptions."""
        if stats.num_preemptions != self._preemptions:
            self._preemptions = stats.num_preemptions
            for rid in _preempted_ids(engine):
                run = self._runs.get(rid)
                if run is not None:
                    run.span.add_event("preemption")
        for out in outputs:
            run = self._runs.get(out.request_id)
            if run is None:
                continue
            if not run.decoding and out.token_ids:
                self._first_token(run, out)
            if out.finished:
                run.span.add_event("finish", {"gen_ai.response.finish_reasons": [out.finish_reason or "stop"],
                                              "gen_ai.usage.completion_tokens": out.completion_tokens})
                run.span.set_attributes({"gen_ai.usage.completion_tokens": out.completion_tokens,
                                         "gen_ai.response.finish_reasons": [out.finish_reason or "stop"]})
                self._close(out.request_id, error=out.finish_reason == "error")

    def ended(self, request_id: str, why: str) -> None:
        """``request_id`` stopped running here without a finish of its own: cancelled,
        its gateway's link lost, handed back on drain, replaced by a newer attempt."""
        run = self._runs.get(request_id)
        if run is not None:
            run.span.set_attribute("inflight.ended", why)
            self._close(request_id)

    def _first_token(self, run: _Run, out: RequestOutput) -> None:
        from opentelemetry.trace import set_span_in_context

        run.phase.set_attribute("inflight.cached_prompt_tokens", out.cached_prompt_tokens)
        run.phase.end()
        run.span.add_event("first_token")
        run.phase = self._tracer.start_span("inflight.decode", context=set_span_in_context(run.span))
        run.decoding = True

    def _close(self, request_id: str, error: bool = False) -> None:
        run = self._runs.pop(request_id)
        run.phase.end()
        if error:
            from opentelemetry.trace import Status, StatusCode

            run.span.set_status(Status(StatusCode.ERROR, "the engine failed the request"))
        run.span.end()


def _preempted_ids(engine: Any) -> list[str]:
    """Request ids the engine's last step preempted.

    The engine exposes no public view of this; ``LLMEngine._last`` (its last
    ``SchedulerOutput``) has ``preempted`` sequences. Read defensively: a changed
    engine costs the ``preemption`` events, nothing else. (A public
    ``EngineStats.last_preempted`` would replace this.)"""
    last = getattr(engine, "_last", None)
    return [seq.request_id for seq in getattr(last, "preempted", ()) or ()]
