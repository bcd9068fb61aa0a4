"""The worker's output fan-out: each engine step's outputs, sorted by gateway.

Every running request has a :class:`Route` (its gateway's link address and which
attempt runs here). After a step, :meth:`OutputFanout.publish` turns the outputs
into one ``StepOutput`` per gateway: each request's tokens in deltas of up to
``stream_interval`` tokens (worker/serve/stream_interval.py), then the ``Finished``
of the requests that ended (a pooling engine's request ends with its ``Embedding``
instead). Outputs of requests aborted here are dropped, not
routed: a newer attempt of the same request id may be running by then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from protos import common_pb2, link_pb2
from worker.engine.engine_types import EmbeddingOutput, RequestOutput
from worker.serve.link_client import LinkPool
from worker.serve.request_codec import FINISH_REASONS, to_logprobs_proto
from worker.serve.stream_interval import StreamBuffer

log = logging.getLogger(__name__)


@dataclass
class Route:
    """Where a running request's output goes: its gateway's link address, which
    attempt runs here (0 = the original entry, n = the gateway's n-th continuation),
    and how many of its choices (``n``) have not finished."""

    address: str
    attempt: int
    unfinished: int = 1


class OutputFanout:
    """Routes of the running requests and the tokens not sent yet.

    Args:
        links: the worker's gateway links.
        tokenizer: the model's tokenizer (a token's raw bytes for logprobs).
        stream_interval: tokens per delta after a request's first (>= 1).
    """

    def __init__(self, links: LinkPool, tokenizer, stream_interval: int):
        self._links = links
        self._tokenizer = tokenizer
        self._routes: dict[str, Route] = {}   # request id -> where its output goes
        self._stale_aborts: set[str] = set()  # aborted here; the engine's abort output is not sent
        self._stream = StreamBuffer(stream_interval)

    def add(self, request_id: str, route: Route) -> None:
        """Route a request that just started here."""
        self._routes[request_id] = route

    def route(self, request_id: str) -> Route | None:
        """Where ``request_id``'s output goes, or None when it does not run here."""
        return self._routes.get(request_id)

    def running(self) -> list[str]:
        """Request ids of every routed (running) request."""
        return list(self._routes)

    def on(self, address: str) -> list[str]:
        """Request ids of the running requests whose gateway is ``address``."""
        return [rid for rid, route in self._routes.items() if route.address == address]

    def num_held(self) -> int:
        """Requests with tokens held back for their next delta."""
        return len(self._stream)

    def drop(self, request_id: str, aborted: bool) -> None:
        """Forget a request's route and held tokens; ``aborted``: the engine aborted it
        here, so its abort output of the next step is not sent."""
        self._routes.pop(request_id, None)
        self._stream.drop(request_id)
        if aborted:
            self._stale_aborts.add(request_id)

    def publish(self, outputs: Iterable[RequestOutput]) -> None:
        """Send one step's outputs: one ``StepOutput`` per gateway that has any (none
        for a gateway whose requests all held their tokens)."""
        by_gateway: dict[str, link_pb2.StepOutput] = {}
        for out in outputs:
            if out.finish_reason == "abort" and out.request_id in self._stale_aborts:
                self._stale_aborts.discard(out.request_id)
                continue
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            step = by_gateway.setdefault(route.address, link_pb2.StepOutput())
            if isinstance(out, EmbeddingOutput):  # a pooling engine's answer ends its request
                step.embeddings.append(link_pb2.Embedding(request_id=out.request_id, values=out.values,
                                                          prompt_tokens=out.prompt_tokens))
                log.info("embedded", extra={"request_id": out.request_id, "prompt_tokens": out.prompt_tokens})
                self._routes.pop(out.request_id, None)
                continue
            logprobs = to_logprobs_proto(out.logprobs, self._tokenizer) if out.logprobs else []
            delta = self._stream.push(out.request_id, out.text_delta, out.token_ids, logprobs, out.finished,
                                      out.index)
            if delta is not None:
                step.deltas.append(delta)
            if out.finished:
                step.finished.append(finished_message(out))
                log.info("finished", extra={"request_id": out.request_id, "finish_reason": out.finish_reason,
                                            "completion_tokens": out.completion_tokens})
                route.unfinished -= 1
                if route.unfinished <= 0:  # every choice has ended
                    self._routes.pop(out.request_id, None)
        for address, step in by_gateway.items():
            link = self._links.link(address)
            if link is not None and (step.deltas or step.finished or step.embeddings):
                link.send(link_pb2.WorkerMessage(step=step))


def finished_message(out: RequestOutput) -> link_pb2.Finished:
    """The link's ``Finished`` for a request's last output."""
    reason = FINISH_REASONS.get(out.finish_reason, common_pb2.FINISH_REASON_STOP)
    usage = common_pb2.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                             cached_prompt_tokens=getattr(out, "cached_prompt_tokens", 0))
    error = getattr(out, "error", "") or ""
    code = (getattr(out, "error_code", "") or "internal") if error else ""
    return link_pb2.Finished(request_id=out.request_id, finish_reason=reason, usage=usage,
                             error=error, error_code=code, index=out.index)
