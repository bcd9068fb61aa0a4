"""The worker process: pull from Redis → engine step → stream deltas to gateways.

One asyncio loop owns everything; the engine step (CPU/GPU heavy, releases the
GIL inside torch) runs on the engine thread (worker/serve/engine_thread.py, the
thread that also loaded the model), and the engine is only touched between
steps, so it needs no locks. The loop per iteration:

1. apply cancels that arrived over the links (``engine.abort``);
2. admit: while the engine can take a request, read one entry
   (worker/serve/intake.py), drop it if expired, hold it while its gateway is
   dialled (worker/serve/dial_queue.py) or defer it if that dial failed a moment
   ago, add it to the engine, send ``Accepted`` and XACK after the ``Ack``;
3. step the engine and send one ``StepOutput`` per gateway
   (worker/serve/fanout.py).

Fencing by lease: a worker whose process was frozen (SIGSTOP, a paused VM) longer than its
heartbeat's TTL has lost its lease: its gateways declared its links lost (keepalive) and
queued its running requests as continuations elsewhere, and other workers took over its own
streams. When it wakes, the loop's watchdog (:class:`LeaseWatch`) sees the gap, and before
it sends anything more it aborts every running request, forgets the entries it held without
touching Redis (they are another worker's now) and closes its links: it delivers no token
twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import redis.asyncio as aioredis

from protos import common_pb2, link_pb2, queue_pb2
from worker.engine.engine import AddStatus, Admission, LLMEngine
from worker.serve.consumer import QueueEntry
from worker.serve.dial_queue import DialQueue
from worker.serve.engine_thread import EngineThread
from worker.serve.fanout import OutputFanout, Route
from worker.serve.intake import Intake
from worker.serve.kv_publisher import KVPublisher
from worker.serve.link_client import UNREACHABLE_S, LinkPool
from worker.serve.metrics import WorkerMetrics
from worker.serve.request_codec import to_engine_request
from worker.serve.settings import WorkerSettings
from worker.serve.stats_logger import StatsLogger
from worker.serve.tracing import WorkerTracing

log = logging.getLogger(__name__)

#: Longest pull block (milliseconds) while an entry waits for its gateway's dial.
DIAL_POLL_MS = 5
#: Seconds a cancel for a request not running here is remembered (a later delivery of the
#: attempt it cancelled is then dropped without a prefill).
EARLY_CANCEL_S = 60.0


class LeaseWatch:
    """Tells whether the process was frozen for longer than its lease.

    A task ticks every ``tick_s`` seconds on the worker's event loop (the engine steps on
    its own thread, so a long step does not stop the ticks); :meth:`lost` is True when the
    last tick is more than ``lease_s`` seconds old, i.e. the whole process stood still.

    Args:
        lease_s: the lease, seconds (the heartbeat's TTL).
        tick_s: seconds between ticks.
    """

    def __init__(self, lease_s: float, tick_s: float = 0.5):
        self.lease_s = lease_s
        self.tick_s = tick_s
        self._last = time.monotonic()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start ticking on the running loop."""
        self._last = time.monotonic()
        self._task = asyncio.create_task(self._tick())

    def stop(self) -> None:
        """Stop ticking."""
        if self._task is not None:
            self._task.cancel()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if not self.lost():  # a late tick must not hide the gap from the loop: it renews only in time
                self._last = time.monotonic()

    def lost(self) -> bool:
        """True when no tick came for ``lease_s`` seconds (the process was frozen)."""
        return time.monotonic() - self._last > self.lease_s

    def renew(self) -> float:
        """Start a new lease after a fence; returns the seconds the process stood still."""
        gap = time.monotonic() - self._last
        self._last = time.monotonic()
        return gap


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
        tracer: an OpenTelemetry ``Tracer`` (worker/serve/tracing.py), or None: tracing off.
        before_step: called on the engine thread before each step (the thread governor's
            ``tick``, worker/serve/thread_governor.py), or None.
    """

    def __init__(self, settings: WorkerSettings, engine: LLMEngine, redis: aioredis.Redis,
                 model_name: str, metrics: WorkerMetrics | None = None,
                 engine_thread: EngineThread | None = None, tracer: object = None,
                 before_step: Callable[[], object] | None = None):
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.metrics = metrics or WorkerMetrics(settings.worker_id, model_name, settings.engine.batching)
        self._intake = Intake(redis, settings, self.metrics, busy=engine.has_unfinished,
                              has_room=lambda: engine.admission(1, 1).verdict is Admission.START)
        #: KV events and load for the gateway's KV-aware router (None: not published, never routed to).
        # (a pooling worker has no prefix cache to route by: it serves the shared streams)
        self._publisher = (KVPublisher(redis, settings.worker_id, engine)
                           if settings.kv_events and settings.runner == "generate" else None)
        self._withdrawn = False
        hello = link_pb2.Hello(worker_id=settings.worker_id, model=model_name)
        self._links = LinkPool(hello, self._on_cancel, self._on_link_lost, secret=settings.link_secret)
        self._dials = DialQueue(self._links)     # the entry whose gateway is being dialled
        self._fanout = OutputFanout(self._links, engine.tokenizer, settings.stream_interval)
        self._engine_thread = engine_thread or EngineThread()
        self._cancels: set[str] = set()           # cancels to apply before the next step
        # cancels for requests not running here: (request id, gateway address) -> (expiry, attempt)
        self._early_cancels: dict[tuple[str, str], tuple[float, int]] = {}
        self._held: QueueEntry | None = None      # read, does not fit yet
        self._unconfirmed: list[QueueEntry] = []  # Accepted got no Ack: release after the abort
        self._steps_seen = 0                      # engine steps that ran the model
        self._stopping = asyncio.Event()
        self._hand_back_at: float | None = None   # monotonic s when the drain grace ends
        self._tracing = WorkerTracing(tracer, settings.worker_id) if tracer is not None else None
        self._before_step = before_step
        self._lease = LeaseWatch(settings.heartbeat_ttl_s)
        #: vLLM's log_stats line every 10 s, and the last minute's throughput gauges
        self._stats_log = StatsLogger(enabled=settings.log_stats)

    # ----------------------------------------------------------------- links
    def _on_cancel(self, request_id: str, address: str, attempt: int | None = None) -> None:
        """A gateway cancelled attempt ``attempt`` of ``request_id`` (None: a gateway that does
        not say, ``link_client.cancelled_attempt``: whatever attempt runs). Abort that
        gateway's run of it here when it runs that attempt or an older one; a cancel of an
        older attempt than the one running is stale (the gateway's late cancel of the first
        run after it took the stream over on a resume and queued attempt 64 or more) and
        ignored. A cancel not applied to a run here is remembered for ``EARLY_CANCEL_S`` (a
        later delivery of that attempt or an older one is dropped: see
        :meth:`_cancelled_early`; None counts as attempt 0). A cancel from another gateway
        than the run's is ignored: the stream was resumed through that one."""
        route = self._fanout.route(request_id)
        if route is not None:
            if route.address != address:
                return
            if attempt is None or attempt >= route.attempt:
                self._cancels.add(request_id)
            if attempt is None or attempt <= route.attempt:
                return
            # a newer attempt than the one running was cancelled: remember it for its delivery
        now = time.monotonic()
        if len(self._early_cancels) >= 1024:  # forget the expired ones
            self._early_cancels = {k: v for k, v in self._early_cancels.items() if v[0] > now}
        self._early_cancels[(request_id, address)] = (now + EARLY_CANCEL_S, attempt or 0)

    def _cancelled_early(self, req: queue_pb2.QueuedRequest) -> bool:
        """True when ``req``'s gateway cancelled this attempt (or a newer one) before it came:
        never for a newer attempt, which that gateway queued after the cancel (a stream it took
        over on a resume, gateway/stream_resume.py, keeps the id and queues attempt 64 or more)."""
        key = (req.request_id, req.reply_to)
        remembered = self._early_cancels.get(key)
        if remembered is None:
            return False
        expiry, attempt = remembered
        if expiry <= time.monotonic():
            del self._early_cancels[key]
            return False
        if req.attempt > attempt:
            return False
        del self._early_cancels[key]
        return True

    def _on_link_lost(self, address: str) -> None:
        self._cancels.update(self._fanout.on(address))

    # ------------------------------------------------------------------ loop
    async def run(self) -> None:
        """Serve until :meth:`stop`; then stop pulling, finish running work (or hand it
        back when the grace period runs out) and return."""
        await self._intake.ensure_groups()
        self._lease.start()
        stalled = False  # the last step ran no model work (a request-level batch is forming)
        while not (self._stopping.is_set() and not self.engine.has_unfinished()):
            if self._lease.lost():
                await self._fence()
            if self._hand_back_at is not None and time.monotonic() >= self._hand_back_at:
                await self._hand_back()
                break
            self._apply_cancels()
            await self._release_unconfirmed()
            failed = self._dials.failed()
            if failed is not None:
                await self._intake.defer(failed, UNREACHABLE_S)
            await self._publish()
            if not self._stopping.is_set():
                await self._intake.refresh_streams()
                await self._admit(self._block_ms(stalled))
                await self._publish()  # what was just admitted counts before its prefill
            if self.engine.has_unfinished():
                stalled = not await self._step()
            elif self._stopping.is_set():
                break
            self._log_stats()
        self._lease.stop()
        dialled = self._dials.drain()
        if dialled is not None:
            await self._intake.release(dialled)
        await self._publish()
        await self._intake.withdraw()
        await self._links.close()
        self._engine_thread.shutdown()
        log.info("drained: the worker stops")

    async def _publish(self) -> None:
        """Publish the KV events and load when due (worker/serve/kv_publisher.py); once
        stopping, withdraw them instead, so the gateways stop routing here at once."""
        if self._publisher is None or self._withdrawn:
            return
        if self._stopping.is_set():
            self._withdrawn = True
            await self._intake.side_call("KV withdraw", self._publisher.withdraw)
        else:
            held = int(self._held is not None) + int(self._dials.pending())
            if self._publisher.due(held):
                await self._intake.side_call("KV events", lambda: self._publisher.publish(held))

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
        if not self._stopping.is_set():  # SIGTERM's drain says so once in the log, as it starts
            log.info("draining: pulling no more requests; %d running get %s to finish",
                     len(self._fanout.running()),
                     "as long as they need" if grace_s is None else f"{max(0.0, grace_s):g} s")
        self._stopping.set()
        if grace_s is not None:
            self._hand_back_at = time.monotonic() + max(0.0, grace_s)

    async def _hand_back(self) -> None:
        """Drain grace ran out: drop every unfinished request without a ``Finished``
        and release the held entry. Closing the links then makes each gateway
        re-queue its requests as continuations (gateway/continuation.py), so their
        clients' streams go on on another worker with nothing lost or repeated."""
        handed = self._fanout.running()
        for request_id in handed:
            self._abort(request_id)
        await self._release_unconfirmed()
        if self._held is not None:
            await self._intake.release(self._held)
            self._held = None
        log.info("drain grace ran out: handed %d unfinished request(s) back", len(handed))

    async def _fence(self) -> None:
        """The process stood still past its lease (:class:`LeaseWatch`): give up everything
        it held before sending anything. Running requests are aborted without a word (their
        gateways queued continuations), the held and dialled entries are forgotten without a
        Redis call (another worker claimed them; an XCLAIM now would take them back), and the
        links are closed, so a gateway that still had one queues its requests elsewhere."""
        gap_s = self._lease.renew()
        running = self._fanout.running()
        for request_id in running:
            self._abort(request_id)
        self._held = None
        self._dials.drain()
        self._unconfirmed.clear()
        await self._links.close()
        self.metrics.observe_state(self.engine.stats())
        log.warning("frozen for %.1f s, past the %.0f s lease: gave up %d running request(s) and "
                    "the entries held; nothing more is sent for them", gap_s, self._lease.lease_s, len(running))

    def _abort(self, request_id: str) -> bool:
        """Stop running ``request_id`` here: free its blocks, forget its route and held
        tokens (its abort output of the next step is not sent). False if not running."""
        aborted = self.engine.abort(request_id)
        self._fanout.drop(request_id, aborted)
        if self._tracing is not None:
            self._tracing.ended(request_id, "aborted")
        return aborted

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
            entry = entry or await self._reclaim() or await self._intake.pull(block_ms)
            block_ms = None
            if entry is None:
                return
            if not await self._start(entry):
                await self._intake.keep_alive(entry)
                return

    async def _reclaim(self) -> QueueEntry | None:
        """A dead worker's idle entry to run, or None; one delivered too often goes to
        the dead-letter stream and its gateway is told."""
        entry = await self._intake.reclaim()
        if entry is None or not self._intake.exhausted(entry):
            return entry
        if await self._intake.dead_letter(entry):
            await self._finish_unstarted(entry, "internal", f"the request was delivered {entry.deliveries} "
                                         "times without completing and was moved to the dead-letter stream")
        return None

    async def _start(self, entry: QueueEntry) -> bool:
        """Try to start one entry. Returns False when it must wait for room (held)."""
        req = entry.request
        running = self._fanout.route(req.request_id)
        if running is not None and req.attempt <= running.attempt:  # a stale second delivery (XACK failed)
            log.info("dropping a second delivery of running request %s", req.request_id)
            await self._intake.ack(entry)
            return True
        if running is not None:  # the gateway lost our link and queued a continuation: it wants that one
            log.info("continuation %d of %s replaces attempt %d", req.attempt, req.request_id, running.attempt)
            self._abort(req.request_id)
            self._cancels.discard(req.request_id)  # a cancel from the lost link was for the old attempt
        if entry.expired or self._cancelled_early(req):
            await self._finish_unstarted(entry, "deadline_exceeded" if entry.expired else None)
            return True
        unreachable_s = self._links.unreachable_for(req.reply_to)
        if unreachable_s > 0:  # its gateway is gone or cut off: do not prefill for nobody
            await self._intake.defer(entry, unreachable_s)
            return True
        if self._links.link(req.reply_to) is None:  # prefill only once the gateway answers the dial
            self._dials.wait(entry)
            return True
        result = self.engine.add_request(to_engine_request(req), only_if_room=True)
        if result.status is AddStatus.NO_ROOM:
            self._held = entry  # fits once running requests free their blocks
            return False
        if not result.ok:
            await self._finish_unstarted(entry, "invalid_request", result.reason)
            return True
        self._fanout.add(req.request_id, Route(req.reply_to, req.attempt, unfinished=max(1, req.sampling.n)))
        if self._tracing is not None:
            self._tracing.started(req, max(0.0, time.time() - req.enqueued_unix_s))
        asyncio.create_task(self._confirm(entry))
        return True

    async def _confirm(self, entry: QueueEntry) -> None:
        """Send Accepted; XACK once the gateway acknowledges. Without an Ack (the link
        broke or stayed silent) abort the run and release the entry, unacknowledged:
        the gateway may have re-dialled or queued this very attempt after a link blip,
        so another delivery (here over a fresh link, or on another worker) gets to run
        it. A gateway that is really gone never acks; the next dial to it fails, and
        its entries are then deferred without a prefill (:meth:`Intake.defer`) until they
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
            await self._intake.ack(entry, in_loop=False)
            return
        route = self._fanout.route(req.request_id)
        if route is not None and route.attempt != req.attempt:
            await self._intake.ack(entry, in_loop=False)  # a newer attempt replaced this one here: superseded
            return
        if route is not None:  # still running: abort it (a cancel may have done so already)
            self._cancels.add(req.request_id)
        self._unconfirmed.append(entry)  # released by the loop after the abort, never found running

    async def _release_unconfirmed(self) -> None:
        """Release the entries whose Accepted got no Ack (their runs are aborted by now)."""
        entries, self._unconfirmed = self._unconfirmed, []
        for entry in entries:
            await self._intake.release(entry)

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
        await self._intake.ack(entry)

    def _log_stats(self) -> None:
        """The stats line when due (worker/serve/stats_logger.py), and the last minute's
        throughput gauges with it."""
        if not self._stats_log.observed:  # nothing stepped yet: start the window now
            self._stats_log.observe(self.engine.stats())
        if self._stats_log.tick():
            self.metrics.observe_throughput(*self._stats_log.window.rates(time.monotonic()))

    def _engine_step(self) -> list:
        """On the engine thread: the governor's tick (it may change the thread count
        between steps), then one engine step."""
        if self._before_step is not None:
            self._before_step()
        return self.engine.step()

    async def _step(self) -> bool:
        """Run one engine step and send its outputs; True when the model ran."""
        started = time.perf_counter()
        outputs = await self._engine_thread.run(self._engine_step)
        if self._lease.lost():  # frozen during the step: its output may be another worker's by now
            await self._fence()
            return True
        stats = self.engine.stats()  # once per step: it walks every block table
        self.metrics.observe_step(stats, time.perf_counter() - started, outputs)
        self._stats_log.observe(stats)
        self._fanout.publish(outputs)
        if self._tracing is not None:
            self._tracing.on_step(outputs, stats, self.engine)
        ran, self._steps_seen = stats.num_steps > self._steps_seen, stats.num_steps
        return ran
