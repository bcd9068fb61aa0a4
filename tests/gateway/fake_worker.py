"""A scripted fake worker that speaks the real worker's protocol (docs/CONTRACTS.md).

Behaviour, step by step:

* heartbeat ``inflight:workers:{worker_id}`` (JSON, TTL 10 s: common/served_model.py, serving
  ``model``, "test-model" by default, the gateway harness's model; no tokenizer fingerprint)
  refreshed every 0.2 s;
* ``XREADGROUP`` group ``inflight-workers`` over ``inflight:requests:{model}:{0,1,2}``
  (group created with MKSTREAM, BUSYGROUP ignored, recreated after a FLUSHALL: NOGROUP,
  or UNBLOCKED for a read blocked during it on Redis >= 7.0);
* entries past their deadline are XACKed and dropped at pull;
* dials ``reply_to`` once per gateway, first message ``Hello``; per request
  ``Accepted``, waits for ``Ack``, then ``XACK`` + ``XDEL``;
* every ``step_s`` seconds one ``StepOutput`` per gateway carrying one delta per
  running request, then the finishes;
* a continuation (``resumed_token_ids``) goes on after that many pieces, as the real
  worker does; ``Accepted`` carries the entry's ``attempt``;
* ``Cancel`` aborts the request before the next step (nothing more is sent for
  it); a cancel for an unknown id is remembered (60 s).

Script (from the prompt, decoded as one character per token like
``CharTokenizer``): "slow" → 500 pieces; "flood" → 100,000 pieces of 4,000 characters; "fail" → FINISH_REASON_ERROR
(``error_code`` "internal"); otherwise ``min(max_tokens, 5)`` pieces ``"w{i} "``
with usage, finish "length" when max_tokens pieces were produced, else "stop".
``SAY[text]SAY`` (the last one in the prompt) → ``text`` in pieces of 3 characters, at
most max_tokens of them, every choice the same but for ``@i``, which becomes the
choice's index (scripted model output, e.g. tool calls). A prompt holding :data:`GATED`
stops after :data:`GATED_PIECES` pieces until the worker's ``gate`` is set (a stream that
cannot have finished when its test breaks it).

Parallel sampling (``sampling.n`` > 1): choice ``i`` emits ``"w{j}"`` + ``".{i}"`` + " "
pieces, one piece fewer for each odd ``i`` (at least one), so choices differ in text,
length and finish reason; every step carries one delta per running choice (each with
its ``index``), the choices interleaved, then a ``Finished`` per choice that ended,
with that choice's usage (``cached_prompt_tokens`` = the prompt for the choices after
the first, which share its blocks). With ``return_logprobs`` each delta carries one
logprob, ``-(index + 0.25)``. ``step_s`` paces each step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import grpc
import redis
import redis.asyncio

from common.redis_keys import stream_name
from protos import common_pb2, link_pb2, link_pb2_grpc, queue_pb2

#: The model the gateway harness (tests/gateway/harness.py) serves.
MODEL = "test-model"


def model_streams(model: str) -> list[str]:
    """The shared request streams of ``model``, highest priority first."""
    return [stream_name(p, model) for p in (0, 1, 2)]


STREAMS = model_streams(MODEL)
#: A prompt holding this (2 characters: the test model's context is 128) is gated:
#: each choice sends :data:`GATED_PIECES` pieces, then waits for ``FakeWorker.gate``.
GATED, GATED_PIECES = "^G", 12
GROUP = "inflight-workers"


@dataclass
class _Choice:
    index: int
    pieces: list[str]
    sent: int = 0
    done: bool = False


@dataclass
class _Running:
    req: queue_pb2.QueuedRequest
    pieces: list[str]
    error: bool = False
    choices: list[_Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = max(1, self.req.sampling.n)
        if not self.choices:
            self.choices = [_Choice(0, self.pieces)]
            for i in range(1, n):
                count = max(1, len(self.pieces) - i % 2)
                self.choices.append(_Choice(i, [p[:-1] + f".{i} " for p in self.pieces[:count]]))

    @property
    def sent(self) -> int:
        """Pieces sent, over every choice."""
        return sum(c.sent for c in self.choices)


@dataclass
class _Link:
    outbox: asyncio.Queue
    acks: dict[str, asyncio.Future] = field(default_factory=dict)
    running: dict[str, _Running] = field(default_factory=dict)


SAY_OPEN, SAY_CLOSE = "SAY[", "]SAY"


def _say(req: queue_pb2.QueuedRequest, prompt: str) -> _Running | None:
    """The ``SAY[text]SAY`` script (module docstring), or None without one."""
    start = prompt.rfind(SAY_OPEN)
    end = prompt.find(SAY_CLOSE, start + len(SAY_OPEN))
    if start < 0 or end < 0:
        return None
    text = prompt[start + len(SAY_OPEN):end]

    def pieces(i: int) -> list[str]:
        said = text.replace("@i", str(i))
        return [said[k:k + 3] for k in range(0, len(said), 3)][:req.sampling.max_tokens]

    n = max(1, req.sampling.n)
    return _Running(req, pieces(0), choices=[_Choice(i, pieces(i)) for i in range(n)])


def script(req: queue_pb2.QueuedRequest) -> _Running:
    """The scripted output for ``req`` (see the module docstring)."""
    prompt = "".join(chr(t) for t in req.prompt_token_ids)
    said = _say(req, prompt)
    if said is not None:
        return said
    if "slow" in prompt:
        return _Running(req, [f"w{i} " for i in range(500)])
    if "flood" in prompt:  # a reader that stops reading fills its socket's buffers at once
        return _Running(req, [f"w{i} ".ljust(4000, "x") for i in range(100_000)])
    if "fail" in prompt:
        return _Running(req, ["w0 "], error=True)
    return _Running(req, [f"w{i} " for i in range(min(req.sampling.max_tokens, 5))])


class FakeWorker:
    """Run with :meth:`start` (own thread and loop) and :meth:`stop`. Observations:
    ``accepted``, ``acked``, ``cancels``, ``finished`` (request ids) and ``requests``."""

    def __init__(self, redis_url: str, worker_id: str = "fake-1", step_s: float = 0.02,
                 link_secret: str | None = None, model: str = MODEL):
        self.redis_url, self.worker_id, self.step_s = redis_url, worker_id, step_s
        self.model = model
        self.streams = model_streams(model)
        self.link_secret = link_secret  # sent as x-inflight-link-secret on Connect
        self.requests: list[queue_pb2.QueuedRequest] = []
        self.accepted: list[str] = []
        self.acked: list[str] = []
        self.cancels: list[str] = []
        self.finished: list[str] = []
        #: Set: :data:`GATED` requests go on past :data:`GATED_PIECES` (module docstring).
        self.gate = threading.Event()
        #: (request id, gateway) -> (when, attempt): a cancel binds that gateway's run of that
        #: attempt or an older one, as the real worker's (worker/serve/service.py).
        self._cancelled: dict[tuple[str, str], tuple[float, int]] = {}
        self._links: dict[str, _Link] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._main: asyncio.Future | None = None

    def start(self) -> "FakeWorker":
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        return self

    def check(self) -> None:
        """Raise when the worker's loop ended (e.g. an unexpected Redis error): its requests
        would otherwise stay queued, unserved, until their deadline."""
        if self._main is not None and self._main.done() and not self._main.cancelled():
            raise RuntimeError(f"fake worker {self.worker_id} died") from self._main.exception()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._main.cancel)
        time.sleep(0.1)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self.check()  # a worker that died mid-session fails the teardown loudly

    async def _run(self) -> None:
        self._redis = redis.asyncio.Redis.from_url(self.redis_url)
        tasks = [asyncio.ensure_future(c) for c in (self._heartbeat(), self._pull(), self._steps())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def _heartbeat(self) -> None:
        while True:
            info = json.dumps({"model": self.model, "served_model_names": [self.model], "batching": "continuous",
                               "started": time.time()})
            await self._redis.set(f"inflight:workers:{self.worker_id}", info, ex=10)
            await asyncio.sleep(0.2)

    async def _ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                await self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _pull(self) -> None:
        await self._ensure_groups()
        while True:
            try:
                batches = await self._redis.xreadgroup(
                    GROUP, self.worker_id, {s: ">" for s in self.streams}, count=8, block=50)
            except redis.ResponseError as exc:
                # A test's FLUSHALL dropped the streams and the group: the next read gets
                # NOGROUP, and on Redis >= 7.0 the read blocked at that moment is ended
                # with "UNBLOCKED the stream key no longer exists". Either way: recreate.
                if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                    raise
                await self._ensure_groups()
                continue
            for stream, entries in batches or []:
                for entry_id, fields in entries:
                    asyncio.ensure_future(self._take(stream, entry_id, fields[b"req"]))

    async def _take(self, stream, entry_id, raw: bytes) -> None:
        req = queue_pb2.QueuedRequest.FromString(raw)
        self.requests.append(req)
        if req.deadline_unix_s and req.deadline_unix_s < time.time():
            await self._redis.xack(stream, GROUP, entry_id)
            await self._redis.xdel(stream, entry_id)
            return
        link = await self._link(req.reply_to)
        ack = link.acks[req.request_id] = self._loop.create_future()
        link.outbox.put_nowait(link_pb2.WorkerMessage(accepted=link_pb2.Accepted(
            request_id=req.request_id, worker_id=self.worker_id, queue_time_s=0.001, attempt=req.attempt)))
        self.accepted.append(req.request_id)
        await ack
        await self._redis.xack(stream, GROUP, entry_id)
        await self._redis.xdel(stream, entry_id)  # as the real worker does (worker/serve/consumer.py)
        cancelled = self._cancelled.get((req.request_id, req.reply_to))
        if cancelled is None or req.attempt > cancelled[1]:  # a cancel binds its gateway's run only
            run = link.running[req.request_id] = script(req)
            run.choices[0].sent = min(len(req.resumed_token_ids), len(run.choices[0].pieces))  # a continuation

    async def _link(self, address: str) -> _Link:
        if address in self._links:
            return self._links[address]
        link = self._links[address] = _Link(asyncio.Queue())
        link.outbox.put_nowait(link_pb2.WorkerMessage(
            hello=link_pb2.Hello(worker_id=self.worker_id, model="fake")))

        async def outgoing():
            while True:
                yield await link.outbox.get()

        channel = grpc.aio.insecure_channel(address)
        metadata = (("x-inflight-link-secret", self.link_secret),) if self.link_secret else None
        call = link_pb2_grpc.LinkStub(channel).Connect(outgoing(), metadata=metadata)
        asyncio.ensure_future(self._incoming(address, link, call, channel))
        return link

    async def _incoming(self, address: str, link: _Link, call, channel) -> None:
        try:
            async for msg in call:
                if msg.WhichOneof("kind") == "ack":
                    self.acked.append(msg.ack.request_id)
                    fut = link.acks.pop(msg.ack.request_id, None)
                    if fut and not fut.done():
                        fut.set_result(None)
                else:
                    rid = msg.cancel.request_id
                    self.cancels.append(rid)
                    self._cancelled[(rid, address)] = (time.monotonic(), msg.cancel.attempt)
                    link.running.pop(rid, None)
        except grpc.aio.AioRpcError:
            pass
        finally:  # link lost: abort everything of that gateway
            self._links.pop(address, None)
            link.running.clear()
            await channel.close()

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            now = time.monotonic()
            self._cancelled = {r: c for r, c in self._cancelled.items() if now - c[0] < 60}
            for link in list(self._links.values()):
                step = self._step(link)
                if step.deltas or step.finished:
                    link.outbox.put_nowait(link_pb2.WorkerMessage(step=step))

    def _step(self, link: _Link) -> link_pb2.StepOutput:
        step = link_pb2.StepOutput()
        for rid, run in list(link.running.items()):
            ended = []
            gated = not self.gate.is_set() and GATED in "".join(chr(t) for t in run.req.prompt_token_ids)
            for choice in run.choices:
                if choice.done or (gated and choice.sent >= GATED_PIECES):
                    continue
                if choice.sent < len(choice.pieces):
                    text = choice.pieces[choice.sent]
                    # One piece = one token, as usage counts them (id = the piece's first character).
                    delta = step.deltas.add(request_id=rid, text=text, index=choice.index,
                                            token_ids=[ord(text[0])] if text else [])
                    if run.req.sampling.return_logprobs:  # the logprob tells the choice apart
                        delta.logprobs.add(token_id=ord(text[0]), token=text,
                                           logprob=-float(choice.index) - 0.25)
                    choice.sent += 1
                if choice.sent == len(choice.pieces) or run.error:
                    choice.done = True
                    ended.append(self._finish(run, choice))
                    if run.error:
                        break
            step.finished.extend(ended)
            if run.error or all(c.done for c in run.choices):
                del link.running[rid]
                self.finished.append(rid)
        return step

    @staticmethod
    def _finish(run: _Running, choice: _Choice) -> link_pb2.Finished:
        prompt = len(run.req.prompt_token_ids)
        usage = common_pb2.Usage(prompt_tokens=prompt, completion_tokens=choice.sent,
                                 cached_prompt_tokens=prompt if choice.index else 0)
        if run.error:
            return link_pb2.Finished(request_id=run.req.request_id, usage=usage,
                                     finish_reason=common_pb2.FINISH_REASON_ERROR,
                                     error="scripted failure", error_code="internal",
                                     index=choice.index)
        reason = (common_pb2.FINISH_REASON_LENGTH if choice.sent >= run.req.sampling.max_tokens
                  else common_pb2.FINISH_REASON_STOP)
        return link_pb2.Finished(request_id=run.req.request_id, finish_reason=reason, usage=usage,
                                 index=choice.index)
