"""The worker's and the gateway's Redis clients survive a Redis restart: the first command
after it must not fail on a pooled connection the restart closed (issue 8 item 3)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.main import redis_client as gateway_redis_client
from gateway.settings import GatewaySettings
from tests.helpers.redis_server import start_redis
from worker.serve.main import redis_client as worker_redis_client


@pytest.mark.parametrize("side", ["worker", "gateway"])
def test_first_commands_after_a_restart_succeed(side):
    server = start_redis(persistent=True)

    async def scenario():
        client = (worker_redis_client(server.url) if side == "worker"
                  else gateway_redis_client(GatewaySettings(redis_url=server.url)))
        try:
            await asyncio.gather(*[client.set(f"k{i}", i) for i in range(4)])  # 4 pooled connections
            server.shutdown(save=True)
            down = await asyncio.gather(client.ping(), return_exceptions=True)
            server.restart()
            return down, await asyncio.gather(*[client.get(f"k{i}") for i in range(4)], return_exceptions=True)
        finally:
            await client.aclose()

    try:
        down, after = asyncio.run(scenario())
    finally:
        server.stop()
    assert isinstance(down[0], Exception)  # Redis really was down
    assert after == [b"0", b"1", b"2", b"3"]


def test_gateway_commands_beyond_the_pool_wait_for_a_connection():
    """More concurrent commands than pooled connections queue for one; they do not fail
    with "Too many connections" (which the gateway would answer as Redis down, 503)."""
    server = start_redis()

    async def scenario():
        client = gateway_redis_client(GatewaySettings(redis_url=server.url, redis_max_connections=2))
        try:
            # each BLPOP holds its connection 0.1 s, so 12 of them cannot all have one at once
            return await asyncio.gather(*[client.blpop(f"none{i}", timeout=0.1) for i in range(12)],
                                        return_exceptions=True)
        finally:
            await client.aclose()

    try:
        results = asyncio.run(scenario())
    finally:
        server.stop()
    assert results == [None] * 12
