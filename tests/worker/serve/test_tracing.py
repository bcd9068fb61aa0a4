"""Traces (common/tracing.py, gateway/tracing.py, worker/serve/tracing.py) with the
SDK's in-memory exporter: one trace per request across a real gateway and a real
WorkerService (fake-runner engine), a continuation joining it, and the worker's
prefill / decode spans with their first-token, preemption and finish events."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis

from gateway import keys
from protos import common_pb2, queue_pb2
from tests.gateway.fake_worker import MODEL
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import start_redis
from tests.worker.engine_helpers import make_engine
from tests.worker.fakes import fake_tokenizer
from worker.serve.service import WorkerService
from worker.serve.settings import WorkerSettings
from worker.serve.tracing import WorkerTracing

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402


def _tracer(exporter: InMemorySpanExporter, service: str):
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test")


@pytest.fixture(scope="module")
def private_redis():
    """A Redis of this module's own (the gateway tests' fake worker would steal entries)."""
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture()
def exporter():
    return InMemorySpanExporter()


@pytest.fixture()
def stack(private_redis, exporter):
    """A real gateway tracing into ``exporter``, an API key, and a factory of traced workers."""
    client = redis.Redis.from_url(private_redis.url)
    client.flushall()
    _, key = keys.create_key(client, "tenant-a", "test")
    client.close()
    gw = start_gateway(private_redis.url, tokenizer=fake_tokenizer(), tracer=_tracer(exporter, "gw"))
    yield gw, key
    gw.stop()


def _worker(redis_url: str, worker_id: str, exporter, step_delay_s: float = 0.0):
    import redis.asyncio as aioredis

    engine = make_engine(num_blocks=64, block_size=4)
    if step_delay_s:
        step = engine.step

        def slow_step():
            time.sleep(step_delay_s)
            return step()
        engine.step = slow_step
    settings = WorkerSettings(redis_url=redis_url, worker_id=worker_id, poll_ms=20, health_port=0,
                              served_model_name=(MODEL,))  # the gateway harness's model
    return WorkerService(settings, engine, aioredis.Redis.from_url(redis_url), "fake",
                         tracer=_tracer(exporter, worker_id))


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _by_name(spans) -> dict[str, list]:
    out: dict[str, list] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


def test_one_trace_across_gateway_and_worker(stack, private_redis, exporter):
    gw, key = stack

    async def scenario():
        worker = _worker(private_redis.url, "w1", exporter)
        task = asyncio.create_task(worker.run())
        try:
            async with httpx.AsyncClient(base_url=gw.rest_url, timeout=20) as http:
                resp = await http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                       json={"prompt": "hello world", "max_tokens": 6, "temperature": 0})
            assert resp.status_code == 200, resp.text
            await _until(lambda: "inflight.worker.request" in _by_name(exporter.get_finished_spans()))
        finally:
            worker.stop()
            await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    spans = _by_name(exporter.get_finished_spans())
    (request,) = spans["inflight.request"]
    (admission,), (queue,) = spans["inflight.admission"], spans["inflight.queue"]
    (work,), (prefill,), (decode,) = (spans["inflight.worker.request"], spans["inflight.prefill"],
                                      spans["inflight.decode"])
    assert {s.context.trace_id for group in spans.values() for s in group} == {request.context.trace_id}
    assert admission.parent.span_id == queue.parent.span_id == request.context.span_id
    assert work.parent.span_id == request.context.span_id and work.parent.is_remote
    assert prefill.parent.span_id == decode.parent.span_id == work.context.span_id
    assert queue.end_time <= work.end_time and prefill.end_time <= decode.start_time
    assert request.attributes["gen_ai.usage.completion_tokens"] == 6
    assert [e.name for e in request.events] == ["first_token"]
    assert [e.name for e in work.events] == ["first_token", "finish"]
    assert work.attributes["inflight.attempt"] == 0 and work.resource.attributes["service.name"] == "w1"


def test_a_continuation_joins_the_same_trace(stack, private_redis, exporter):
    """Worker 1's drain grace runs out mid-stream: the gateway re-queues a continuation,
    worker 2 finishes it; both workers' spans hang under the one request span."""
    gw, key = stack

    async def scenario():
        first = _worker(private_redis.url, "w1", exporter, step_delay_s=0.02)
        first_task = asyncio.create_task(first.run())
        second = second_task = None
        text = ""
        try:
            async with httpx.AsyncClient(base_url=gw.rest_url, timeout=30) as http:
                async with http.stream("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                       json={"prompt": "hello world", "max_tokens": 40, "temperature": 0,
                                             "stream": True}) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        text += json.loads(line[6:])["choices"][0]["text"]
                        if second is None and text:
                            first.stop(grace_s=0.0)  # hand it back: the link closes
                            await asyncio.wait_for(first_task, 10)
                            second = _worker(private_redis.url, "w2", exporter)
                            second_task = asyncio.create_task(second.run())
            await _until(lambda: len(_by_name(exporter.get_finished_spans()).get("inflight.worker.request", []))
                         == 2)
        finally:
            if not first_task.done():
                first.stop()
                await asyncio.wait_for(first_task, 10)
            if second is not None:
                second.stop()
                await asyncio.wait_for(second_task, 10)
        return text

    asyncio.run(scenario())
    spans = _by_name(exporter.get_finished_spans())
    (request,) = spans["inflight.request"]
    assert {s.context.trace_id for group in spans.values() for s in group} == {request.context.trace_id}
    works = sorted(spans["inflight.worker.request"], key=lambda s: s.attributes["inflight.attempt"])
    assert [w.attributes["inflight.worker_id"] for w in works] == ["w1", "w2"]
    assert [w.attributes["inflight.attempt"] for w in works] == [0, 1]
    assert all(w.parent.span_id == request.context.span_id for w in works)
    assert works[0].attributes["inflight.ended"] == "aborted"  # handed back, no finish of its own
    assert works[1].attributes["inflight.resumed_tokens"] > 0
    assert [e.name for e in works[1].events][-1] == "finish"
    assert [q.attributes["inflight.attempt"] for q in spans["inflight.queue"]] == [0, 1]
    assert "continuation" in [e.name for e in request.events]
    assert request.attributes["gen_ai.usage.completion_tokens"] == 40


def test_worker_spans_mark_first_token_preemption_and_finish():
    """Two requests outgrow a 6-block cache: the later one is preempted (recompute)."""
    exporter = InMemorySpanExporter()
    tracing = WorkerTracing(_tracer(exporter, "w"), "w")
    engine = make_engine(num_blocks=6, block_size=4)
    tok = fake_tokenizer()
    from tests.worker.engine_helpers import request

    for rid in ("a", "b"):
        engine.add_request(request(rid, "hello world", max_tokens=12, ignore_eos=True))
        tracing.started(queue_pb2.QueuedRequest(request_id=rid, prompt_token_ids=tok.encode("hello world"),
                                                sampling=common_pb2.SamplingParams(max_tokens=12)), 0.0)
    while engine.has_unfinished():
        outputs = engine.step()
        tracing.on_step(outputs, engine.stats(), engine)
    assert engine.stats().num_preemptions > 0 and len(tracing) == 0
    spans = _by_name(exporter.get_finished_spans())
    works = {s.attributes["gen_ai.request.id"]: s for s in spans["inflight.worker.request"]}
    events = {rid: [e.name for e in s.events] for rid, s in works.items()}
    assert any("preemption" in names for names in events.values())
    assert all(names[0] == "first_token" and names[-1] == "finish" for names in events.values())
    assert len(spans["inflight.prefill"]) == len(spans["inflight.decode"]) == 2
    assert all(s.attributes["gen_ai.usage.completion_tokens"] == 12 for s in works.values())
