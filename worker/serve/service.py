"""The worker process: pull from Redis → engine step → stream deltas to gateways.

One asyncio loop owns everything; the engine step (CPU/GPU heavy, releases the
GIL inside torch) runs on the engine thread (worker/serve/engine_thread.py, the
thread that also loaded the model), and the engine is only touched between
steps, so it needs no locks. The loop per iteration:

1. apply cancels that arrived over the links (``engine.abort``);
2. admit: while the engine can take a request, XREADGROUP one entry, drop it if
   expired, hold it while its gateway is dialled (worker/serve/dial_queue.py) or defer
   it if that dial failed a moment ago, add it to the engine, send ``Accepted``
   and XACK after the ``Ack``; Redis calls here are bounded while requests run
   (worker/serve/redis_backoff.py);
3. step the engine and send one ``StepOutput`` per gateway (each request's tokens
   in deltas of up to ``stream_interval`` tokens, worker/serve/stream_interval.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from protos import common_pb2, link_pb2
from worker.serve.consumer import QueueEntry, StreamConsumer
from worker.serve.dial_queue import DialQueue
from worker.engine.engine import LLMEngine
from worker.serve.engine_thread import EngineThread
from worker.serve.link_client import UNREACHABLE_S, LinkPool
from worker.serve.metrics import WorkerMetrics
from worker.serve.redis_backoff import LOOP_REDIS_TIMEOUT_S, RedisBackoff
from worker.serve.reclaim import Reclaimer, ReclaimSettings
from worker.serve.request_codec import FINISH_REASONS, to_engine_request, to_logprobs_proto
from worker.serve.settings import WorkerSettings
from worker.serve.stream_interval import StreamBuffer

log = logging.getLogger(__name__)

#: Longest pull block (milliseconds) while an entry waits for its gateway's dial.
DIAL_POLL_MS = 5
#: What a failed Redis call of the loop raises (a bounded call: asyncio's TimeoutError).
REDIS_FAILURES = (RedisError, OSError, asyncio.TimeoutError)
#: The failures that mean Redis is unreachable or hangs, the ones the loop backs off from;
#: an error Redis answered with (a ResponseError) is logged and the loop goes on.
REDIS_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)
T = TypeVar("T")


@dataclass(frozen=True)
class Route:
    """Where a running request's output goes: its gateway's link address, and which
    attempt runs here (0 = the original entry, n = the gateway's n-th continuation)."""

    address: str
    attempt: int


class WorkerService:
    """Runs one engine against the Redis queue and the gateway links.

    Args:
        settings: the worker's settings.
        engine: a ready engine (weights loaded, warmed up).
        redis: an asyncio Redis client.
        model_name: served model id, sent in ``Hello``.
        metrics: the worker's metrics (default: new ones).
        engine_thread: where steps run; pass the thread that loaded the model
            (see worker/serve/engine_thread.py for why). Default: a new one.
    """

    def __init__(self, settings: WorkerSettings, engine: LLMEngine, redis: aioredis.Redis,
                 model_name: str, metrics: WorkerMetrics | None = None,
                 engine_thread: EngineThread | None = None):
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.metrics = metrics or WorkerMetrics(settings.worker_id, model_name, settings.batching)
        self._consumer = StreamConsumer(redis, settings.worker_id, settings.priorities)
        self._reclaimer = Reclaimer(redis, self._consumer, settings.worker_id, settings.priorities,
                                    ReclaimSettings(settings.claim_idle_ms, settings.max_deliveries))
        hello = link_pb2.Hello(worker_id=settings.worker_id, model=model_name)
        self._links = LinkPool(hello, self._on_cancel, self._on_link_lost)
        self._dials = DialQueue(self._links)     # the entry whose gateway is being dialled
        self._redis_backoff = RedisBackoff()     # pause of the loop's Redis polling after a failure
        self._engine_thread = engine_thread or EngineThread()
        self._routes: dict[str, Route] = {}       # request id -> where its output goes
        self._stale_aborts: set[str] = set()      # aborted here; the engine's abort output is not sent
        self._stream = StreamBuffer(settings.stream_interval)  # tokens not sent yet
        self._cancels: set[str] = set()           # cancels to apply before the next step
        self._early_cancels: dict[str, float] = {}  # cancels for requests not seen yet -> expiry
        self._held: QueueEntry | None = None      # read, does not fit yet
        self._unconfirmed: list[QueueEntry] = []  # Accepted got no Ack: release after the abort
        self._steps_seen = 0                      # engine steps that ran the model
        self._stopping = asyncio.Event()
        self._hand_back_at: float | None = None   # monotonic s when the drain grace ends

    # ----------------------------------------------------------------- links
    def _on_cancel(self, request_id: str) -> None:
        if request_id in self._routes:
            self._cancels.add(request_id)
        else:
            self._early_cancels[request_id] = time.monotonic() + 60.0

    def _on_link_lost(self, address: str) -> None:
        self._cancels.update(rid for rid, route in self._routes.items() if route.address == address)

    # ------------------------------------------------------------------ loop
    async def run(self) -> None:
        """Serve until :meth:`stop`; then stop pulling, finish running work (or hand it
        back when the grace period runs out) and return."""
        await self._consumer.ensure_groups()
        stalled = False  # the last step ran no model work (a request-level batch is forming)
        while not (self._stopping.is_set() and not self.engine.has_unfinished()):
            if self._hand_back_at is not None and time.monotonic() >= self._hand_back_at:
                await self._hand_back()
                break
            self._apply_cancels()
            await self._release_unconfirmed()
            failed = self._dials.failed()
            if failed is not None:
                await self._defer(failed, UNREACHABLE_S)
            if not self._stopping.is_set():
                await self._admit(self._block_ms(stalled))
            if self.engine.has_unfinished():
                stalled = not await self._step()
            elif self._stopping.is_set():
                break
        dialled = self._dials.drain()
        if dialled is not None:
            await self._release(dialled)
        await self._links.close()
        self._engine_thread.shutdown()

    def _block_ms(self, stalled: bool) -> int | None:
        """How long the next pull may block: the poll period when idle, until the
        dynamic batch is due when a batch is forming, not at all while stepping;
        at most ``DIAL_POLL_MS`` while an entry waits for its gateway's dial."""
        poll_ms = min(self.settings.poll_ms, DIAL_POLL_MS) if self._dials.pending() else self.settings.poll_ms
        if not self.engine.has_unfinished():
            return poll_ms
        if not stalled:
            return None
        due = self.engine.next_batch_at()
        if due is None:
            return poll_ms
        return max(1, min(poll_ms, int((due - time.monotonic()) * 1000)))

    def stop(self, grace_s: float | None = None) -> None:
        """Ask the loop to stop pulling and return once running requests are done.

        Args:
            grace_s: seconds they get to finish (None = as long as they need); what is
                still unfinished then is handed back (see :meth:`_hand_back`).
        """
        self._stopping.set()
        if grace_s is not None:
            self._hand_back_at = time.monotonic() + max(0.0, grace_s)

    async def _hand_back(self) -> None:
        """Drain grace ran out: drop every unfinished request without a ``Finished``
        and release the held entry. Closing the links then makes each gateway
        re-queue its requests as continuations (gateway/continuation.py), so their
        clients' streams go on on another worker with nothing lost or repeated."""
        handed = list(self._routes)
        for request_id in handed:
            self._abort(request_id)
        await self._release_unconfirmed()
        if self._held is not None:
            await self._release(self._held)
            self._held = None
        log.info("drain grace ran out: handed %d unfinished request(s) back", len(handed))

    def _abort(self, request_id: str) -> bool:
        """Stop running ``request_id`` here: free its blocks, forget its route and held
        tokens. The engine's abort output (next step) is dropped, not routed: a newer
        attempt of the same request id may be running by then. False if not running."""
        self._routes.pop(request_id, None)
        self._stream.drop(request_id)
        if not self.engine.abort(request_id):
            return False
        self._stale_aborts.add(request_id)
        return True

    def _apply_cancels(self) -> None:
        for request_id in self._cancels:
            if self._abort(request_id):
                self.metrics.aborts.inc()
        if self._cancels:
            self.metrics.observe_state(self.engine.stats())
        self._cancels.clear()

    async def _admit(self, block_ms: int | None) -> None:
        """Pull entries (idle ones of dead workers first) while the engine can start
        them; only the first pull may block. None is read while an entry waits for
        its gateway's dial, so at most one entry is off both Redis and the engine."""
        while True:
            entry = self._dials.ready()
            if entry is None:
                entry, self._held = self._held, None
            if entry is None and self._dials.pending():  # read no more until that dial is settled
                if block_ms:
                    await asyncio.sleep(block_ms / 1000)
                return
            entry = entry or await self._reclaim() or await self._pull(block_ms)
            block_ms = None
            if entry is None:
                return
            if not await self._start(entry):
                await self._keep_alive(entry)
                return

    # ----------------------------------------------------------------- redis
    async def _bounded(self, call: Awaitable[T], block_ms: int | None = None) -> T:
        """Await one Redis call of the loop. While requests run it may take at most
        ``LOOP_REDIS_TIMEOUT_S`` plus its block time (worker/serve/redis_backoff.py).

        Raises:
            asyncio.TimeoutError: the bound passed; RedisError/OSError as the call does.
        """
        if not self.engine.has_unfinished():
            return await call
        return await asyncio.wait_for(call, LOOP_REDIS_TIMEOUT_S + (block_ms or 0) / 1000)

    async def _poll(self, what: str, call: Callable[[], Awaitable[T]], block_ms: int | None = None) -> T | None:
        """One polling call of the loop (``what``: XAUTOCLAIM, XREADGROUP), bounded, and
        skipped (None) while the backoff after an outage lasts or the engine is full.
        An outage (connection error, timeout) starts or extends the backoff; an error
        Redis answered with is only logged. Returns the call's result, or None."""
        if not self.engine.can_admit(1, 1) or not self._redis_backoff.allows():
            if block_ms:
                await asyncio.sleep(block_ms / 1000)
            return None
        try:
            result = await self._bounded(call(), block_ms)
        except REDIS_FAILURES as exc:
            if isinstance(exc, REDIS_UNAVAILABLE):
                pause_s = self._redis_backoff.failed()
                log.warning("%s failed (%s): the loop polls Redis again in %.1f s", what, _why(exc), pause_s)
            else:
                log.warning("%s failed: %s", what, _why(exc))
            return None
        self._redis_backoff.succeeded()
        return result

    async def _reclaim(self) -> QueueEntry | None:
        entry = await self._poll("XAUTOCLAIM", self._reclaimer.claim)
        if entry is None or not self._reclaimer.exhausted(entry):
            return entry
        try:
            await self._bounded(self._reclaimer.dead_letter(entry))
        except REDIS_FAILURES as exc:  # the claimed entry stays pending: claimed again later
            log.warning("could not dead-letter %s: %s", entry.entry_id, _why(exc))
            return None
        await self._finish_unstarted(entry, "internal", f"the request was delivered {entry.deliveries} "
                                     "times without completing and was moved to the dead-letter stream")
        return None

    async def _keep_alive(self, entry: QueueEntry) -> None:
        try:
            await self._bounded(self._reclaimer.keep_alive(entry))
        except REDIS_FAILURES as exc:
            log.warning("XCLAIM keep-alive failed: %s", _why(exc))

    async def _pull(self, block_ms: int | None) -> QueueEntry | None:
        return await self._poll("XREADGROUP", lambda: self._consumer.read_one(block_ms), block_ms)

    async def _start(self, entry: QueueEntry) -> bool:
        """Try to start one entry. Returns False when it must wait for room (held)."""
        req = entry.request
        running = self._routes.get(req.request_id)
        if running is not None and req.attempt <= running.attempt:  # a stale second delivery (XACK failed)
            log.info("dropping a second delivery of running request %s", req.request_id)
            await self._ack(entry)
            return True
        if running is not None:  # the gateway lost our link and queued a continuation: it wants that one
            log.info("continuation %d of %s replaces attempt %d", req.attempt, req.request_id, running.attempt)
            self._abort(req.request_id)
            self._cancels.discard(req.request_id)  # a cancel from the lost link was for the old attempt
        if entry.expired or self._early_cancels.pop(req.request_id, None):
            await self._finish_unstarted(entry, "deadline_exceeded" if entry.expired else None)
            return True
        unreachable_s = self._links.unreachable_for(req.reply_to)
        if unreachable_s > 0:  # its gateway is gone or cut off: do not prefill for nobody
            await self._defer(entry, unreachable_s)
            return True
        if self._links.link(req.reply_to) is None:  # prefill only once the gateway answers the dial
            self._dials.wait(entry)
            return True
        context = len(req.prompt_token_ids) + len(req.resumed_token_ids)  # a continuation re-prefills its output
        too_big = self.engine.never_fits(len(req.prompt_token_ids), req.sampling.max_tokens)
        if too_big is None and not self.engine.can_admit(context, req.sampling.max_tokens - len(req.resumed_token_ids)):
            self._held = entry  # fits once running requests free their blocks
            return False
        result = self.engine.add_request(to_engine_request(req))
        if not result.ok:
            await self._finish_unstarted(entry, "invalid_request", result.reason)
            return True
        self._routes[req.request_id] = Route(req.reply_to, req.attempt)
        asyncio.create_task(self._confirm(entry))
        return True

    async def _defer(self, entry: QueueEntry, after_s: float) -> None:
        """Leave an entry whose gateway could not be dialled for a later delivery,
        ``after_s`` seconds from now. Each deferral costs a delivery, so the entries
        of a gateway that stays gone reach the dead-letter stream after
        ``max_deliveries`` without a prefill; those of a gateway that was cut off
        for a moment run on a later delivery."""
        self.metrics.deferred.inc()
        log.info("gateway %s unreachable: deferring %s by %.1f s (delivery %d)",
                 entry.request.reply_to, entry.request.request_id, after_s, entry.deliveries)
        try:
            await self._bounded(self._reclaimer.defer(entry, after_s))
        except REDIS_FAILURES as exc:  # then it is reclaimed after claim_idle_ms
            log.warning("could not defer %s: %s", entry.entry_id, _why(exc))

    async def _confirm(self, entry: QueueEntry) -> None:
        """Send Accepted; XACK once the gateway acknowledges. Without an Ack (the link
        broke or stayed silent) abort the run and release the entry, unacknowledged:
        the gateway may have re-dialled or queued this very attempt after a link blip,
        so another delivery (here over a fresh link, or on another worker) gets to run
        it. A gateway that is really gone never acks; the next dial to it fails, and
        its entries are then deferred without a prefill (:meth:`_defer`) until they
        reach the dead-letter stream after ``max_deliveries``."""
        req = entry.request
        link = await self._links.get(req.reply_to)
        accepted = link_pb2.Accepted(request_id=req.request_id, worker_id=self.settings.worker_id,
                                     queue_time_s=max(0.0, time.time() - req.enqueued_unix_s),
                                     attempt=req.attempt)
        if await link.accept(accepted):
            self.metrics.queue_time.observe(accepted.queue_time_s)
            log.info("accepted", extra={"request_id": req.request_id, "tenant": req.tenant,
                                        "prompt_tokens": len(req.prompt_token_ids), "attempt": req.attempt,
                                        "resumed_tokens": len(req.resumed_token_ids),
                                        "queue_time_s": round(accepted.queue_time_s, 4)})
            await self._ack(entry, in_loop=False)
            return
        route = self._routes.get(req.request_id)
        if route is not None and route.attempt != req.attempt:
            await self._ack(entry, in_loop=False)  # a newer attempt replaced this one here: superseded
            return
        if route is not None:  # still running: abort it (a cancel may have done so already)
            self._cancels.add(req.request_id)
        self._unconfirmed.append(entry)  # released by the loop after the abort, never found running

    async def _release_unconfirmed(self) -> None:
        """Release the entries whose Accepted got no Ack (their runs are aborted by now)."""
        entries, self._unconfirmed = self._unconfirmed, []
        for entry in entries:
            await self._release(entry)

    async def _release(self, entry: QueueEntry) -> None:
        """Hand an entry this worker will not run to the next ``XAUTOCLAIM`` at once."""
        try:
            await self._bounded(self._reclaimer.release(entry))
        except REDIS_FAILURES as exc:  # then it is reclaimed after claim_idle_ms
            log.warning("could not release %s: %s", entry.entry_id, _why(exc))

    async def _ack(self, entry: QueueEntry, in_loop: bool = True) -> None:
        """XACK an entry; bounded when called from the loop (``in_loop``), not from a
        confirmation task, which holds up nothing and should not give up early. A
        failed XACK leaves the entry pending, delivered again after ``claim_idle_ms``:
        dropped as stale while the request runs here, cancelled by its gateway after."""
        call = self._consumer.ack(entry)
        try:
            await (self._bounded(call) if in_loop else call)
        except REDIS_FAILURES as exc:
            log.warning("XACK of %s failed: %s", entry.entry_id, _why(exc))

    async def _finish_unstarted(self, entry: QueueEntry, code: str | None, message: str = "") -> None:
        """Tell the gateway an entry will not run (expired, cancelled, invalid) and drop it."""
        req = entry.request
        if code is not None:
            reason = common_pb2.FINISH_REASON_ERROR
            text = message or "the request's deadline passed while it was queued"
        else:
            reason, text = common_pb2.FINISH_REASON_ABORT, ""
        finished = link_pb2.Finished(request_id=req.request_id, finish_reason=reason,
                                     error=text, error_code=code or "",
                                     usage=common_pb2.Usage(prompt_tokens=len(req.prompt_token_ids)))
        try:
            if self._links.unreachable_for(req.reply_to) > 0:
                raise ConnectionError("its gateway could not be dialled a moment ago")
            link = await self._links.get(req.reply_to)
            link.send(link_pb2.WorkerMessage(step=link_pb2.StepOutput(finished=[finished])))
        except Exception as exc:  # noqa: BLE001 - the gateway may be gone; the entry is dropped anyway
            log.info("could not report %s to %s: %s", req.request_id, req.reply_to, exc)
        await self._ack(entry)

    async def _step(self) -> bool:
        """Run one engine step and send its outputs; True when the model ran."""
        started = time.perf_counter()
        outputs = await self._engine_thread.run(self.engine.step)
        stats = self.engine.stats()  # once per step: it walks every block table
        self.metrics.observe_step(stats, time.perf_counter() - started, outputs)
        by_gateway: dict[str, link_pb2.StepOutput] = {}
        for out in outputs:
            if out.finish_reason == "abort" and out.request_id in self._stale_aborts:
                self._stale_aborts.discard(out.request_id)
                continue
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            address = route.address
            logprobs = to_logprobs_proto(out.logprobs, self.engine.tokenizer) if out.logprobs else []
            delta = self._stream.push(out.request_id, out.text_delta, out.token_ids, logprobs, out.finished)
            if delta is not None:
                by_gateway.setdefault(address, link_pb2.StepOutput()).deltas.append(delta)
            if out.finished:
                by_gateway.setdefault(address, link_pb2.StepOutput()).finished.append(_finished_message(out))
                log.info("finished", extra={"request_id": out.request_id, "finish_reason": out.finish_reason,
                                            "completion_tokens": out.completion_tokens})
                self._routes.pop(out.request_id, None)
        for address, step in by_gateway.items():
            link = self._links.link(address)
            if link is not None:
                link.send(link_pb2.WorkerMessage(step=step))
        ran, self._steps_seen = stats.num_steps > self._steps_seen, stats.num_steps
        return ran


def _finished_message(out) -> link_pb2.Finished:
    reason = FINISH_REASONS.get(out.finish_reason, common_pb2.FINISH_REASON_STOP)
    usage = common_pb2.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                             cached_prompt_tokens=getattr(out, "cached_prompt_tokens", 0))
    error = getattr(out, "error", "") or ""
    return link_pb2.Finished(request_id=out.request_id, finish_reason=reason, usage=usage,
                             error=error, error_code="internal" if error else "")


def _why(exc: BaseException) -> str:
    """A failure's message for the log (a bounded call's TimeoutError has none)."""
    return str(exc) or type(exc).__name__
