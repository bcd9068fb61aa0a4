"""The gateway's spans of one request (common/tracing.py says when tracing is on).

One ``inflight.request`` span per submitted request, from ``submit`` to its last
event (finish, error, cancel, deadline), with children:

* ``inflight.admission``: validation and the per-key/queue admission script;
* ``inflight.queue``: from the XADD until a worker's ``Accepted`` for that attempt;
  a continuation (gateway/continuation.py) opens a new one, with its ``attempt``.

Its W3C ``traceparent`` goes into ``QueuedRequest.traceparent``; the worker's spans
(worker/serve/tracing.py) are children of the request span, continuations too
(they copy the original message), so a request is one trace across the processes.
Events on the request span: ``first_token``, ``continuation``.

Nothing here runs when tracing is off: ``GatewayService.tracer`` is then None and
every hook is skipped, so no span is created.
"""

from __future__ import annotations

from typing import Any

from common.tracing import traceparent_of
from protos import common_pb2, link_pb2


class RequestTrace:
    """The spans of one request; every method is safe to call after :meth:`end`."""

    def __init__(self, tracer: Any, tenant: str, key_id: str):
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._tracer = tracer
        self.span = tracer.start_span("inflight.request", kind=SpanKind.SERVER,
                                      attributes={"inflight.tenant": tenant, "inflight.key_id": key_id})
        self._context = set_span_in_context(self.span)
        self.traceparent = traceparent_of(self.span)
        self._admission: Any = None
        self._queue: Any = None
        self._ended = False

    def set_request(self, request_id: str, prompt_tokens: int, max_tokens: int, priority: int) -> None:
        """What admission decided (called while the queue message is built)."""
        self.span.set_attributes({"gen_ai.request.id": request_id, "gen_ai.usage.prompt_tokens": prompt_tokens,
                                  "gen_ai.request.max_tokens": max_tokens, "inflight.priority": priority})

    def admission_started(self) -> None:
        """Validation and the admission checks begin: open the ``inflight.admission`` span."""
        self._admission = self._tracer.start_span("inflight.admission", context=self._context)

    def admission_ended(self, error: BaseException | None = None) -> None:
        """Admission is over (``error``: the rejection, recorded on the span)."""
        if self._admission is not None:
            _end(self._admission, error)
            self._admission = None

    def queued(self, attempt: int = 0) -> None:
        """The request (attempt ``attempt``) is about to be XADDed."""
        if self._ended:
            return
        if self._queue is not None:
            self._queue.end()
        self._queue = self._tracer.start_span("inflight.queue", context=self._context,
                                              attributes={"inflight.attempt": attempt})

    def accepted(self, attempt: int) -> None:
        """A worker sent ``Accepted`` for ``attempt``: the queue wait is over."""
        if self._queue is not None:
            self._queue.end()
            self._queue = None
        if not self._ended:
            self.span.set_attribute("inflight.attempts", attempt + 1)

    def continuation(self, attempt: int, outcome: str, resumed_tokens: int) -> None:
        """The request is re-queued as continuation ``attempt`` (its worker's link dropped,
        or its queue entry vanished)."""
        if self._ended:
            return
        self.span.add_event("continuation", {"inflight.attempt": attempt, "inflight.why": outcome,
                                             "inflight.resumed_tokens": resumed_tokens})
        self.queued(attempt)

    def first_token(self) -> None:
        """The client's first token went out: an event on the request span."""
        if not self._ended:
            self.span.add_event("first_token")

    def end(self, *, finished: link_pb2.Finished | None = None, error: BaseException | None = None,
            cancelled: bool = False) -> None:
        """End every open span of the request, once."""
        if self._ended:
            return
        self._ended = True
        self.admission_ended(error)
        if self._queue is not None:
            _end(self._queue, error)
            self._queue = None
        if finished is not None:
            self.span.set_attributes({
                "gen_ai.response.finish_reasons": [common_pb2.FinishReason.Name(finished.finish_reason)],
                "gen_ai.usage.prompt_tokens": finished.usage.prompt_tokens,
                "gen_ai.usage.completion_tokens": finished.usage.completion_tokens})
        if cancelled:
            self.span.set_attribute("inflight.cancelled", True)
        _end(self.span, error)


def _end(span: Any, error: BaseException | None) -> None:
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {getattr(error, 'message', error)}"))
        kind = getattr(error, "kind", None)
        if kind:
            span.set_attribute("inflight.error", str(kind))
    span.end()
