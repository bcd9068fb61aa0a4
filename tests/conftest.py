"""Session-wide fixtures: a private Redis server (never the shared 6379)."""

from __future__ import annotations

import pytest

from tests.helpers.redis_server import RedisServer, start_redis


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    """One private Redis for the whole test session."""
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    """URL of the private Redis, emptied (FLUSHALL) before each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
