"""A worker serving LoRA adapters end to end on its side: queued requests naming an adapter,
none, or one it does not serve go through a real Redis and a real WorkerService (a real engine
over a tiny random Llama, LoRA on) to a fake gateway over real gRPC. Each runs in the same
batch; the adapter's text is the engine's own for that adapter; the unknown adapter finishes
with a clear error and harms nothing else."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from bench.lora import write_random_adapter
from protos import common_pb2, link_pb2_grpc, queue_pb2
from tests.helpers.redis_server import free_port
from tests.worker.engine_helpers import drain
from tests.worker.fakes import fake_tokenizer
from tests.worker.serve.test_worker_service import FakeGateway, _until, private_redis, redis_url  # noqa: F401
from worker.engine.engine import EngineRequest, LLMEngine
from worker.engine.engine_config import EngineConfig
from worker.engine.sampling_params import SamplingParams
from worker.serve.consumer import stream_name
from worker.serve.service import WorkerService
from worker.serve.settings import WorkerSettings

PROMPT = "continuous batching keeps the accelerator busy"


def _engine(adapter: str) -> LLMEngine:
    from worker.model.model_runner import tiny_random_runner

    tokenizer = fake_tokenizer()
    runner = tiny_random_runner(vocab_size=tokenizer.vocab_size, num_blocks=64)
    engine = LLMEngine(runner, tokenizer, EngineConfig(block_size=16, enable_lora=True, max_loras=2))
    engine.add_lora("sql", adapter)
    return engine


def _stream(settings: WorkerSettings) -> str:
    """The priority-1 stream of the worker's model."""
    return stream_name(1, settings.model_id)


def _expected(adapter: str) -> dict[str, str]:
    """The text of the prompt with and without the adapter from a bare engine."""
    engine = _engine(adapter)
    ids = fake_tokenizer().encode(PROMPT)
    for rid, lora in (("base", ""), ("sql", "sql")):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        assert engine.add_request(EngineRequest(rid, ids, params, lora_name=lora)).ok
    return {rid: r.text for rid, r in drain(engine).items()}


def test_adapter_base_and_unknown_adapter_requests_through_the_worker(redis_url, tmp_path):  # noqa: F811
    from worker.model.model_runner import tiny_random_runner

    config = tiny_random_runner(vocab_size=fake_tokenizer().vocab_size, num_blocks=4).config
    adapter = write_random_adapter(tmp_path / "sql", config, rank=8, seed=3)
    expected = _expected(adapter)
    assert expected["sql"] != expected["base"]  # the adapter changes the text

    async def scenario():
        import grpc

        gateway, port = FakeGateway(), free_port()
        server = grpc.aio.server()
        link_pb2_grpc.add_LinkServicer_to_server(gateway, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        client = aioredis.Redis.from_url(redis_url)
        engine = _engine(adapter)
        settings = WorkerSettings(redis_url=redis_url, worker_id="w1", poll_ms=20, health_port=0)
        service = WorkerService(settings, engine, client, "tiny")
        task = asyncio.create_task(service.run())
        try:
            for rid, lora in (("base", ""), ("sql", "sql"), ("nope", "nope")):
                request = queue_pb2.QueuedRequest(
                    request_id=rid, tenant="t", prompt_token_ids=fake_tokenizer().encode(PROMPT),
                    sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    priority=1, reply_to=f"127.0.0.1:{port}", enqueued_unix_s=time.time(), lora_name=lora)
                await client.xadd(_stream(settings), {"req": request.SerializeToString()})
            await _until(lambda: {"base", "sql", "nope"} <= set(gateway.finished), timeout_s=60)
            refused = gateway.finished["nope"]
            assert refused.finish_reason == common_pb2.FINISH_REASON_ERROR
            assert refused.error_code == "invalid_request" and "unknown LoRA adapter 'nope'" in refused.error
            assert "sql" not in refused.error  # the adapters it serves stay unnamed
            for rid in ("base", "sql"):
                assert gateway.finished[rid].finish_reason == common_pb2.FINISH_REASON_LENGTH, rid
                assert gateway.text[rid] == expected[rid], rid
        finally:
            service.stop()
            await asyncio.wait_for(task, 10)
            await server.stop(0)
            await client.aclose()
        assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
        assert engine.loras.held() == {}

    asyncio.run(asyncio.wait_for(scenario(), 120))
