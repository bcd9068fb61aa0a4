"""``redis+sentinel://`` URLs (common/redis_connect.py): parsed into sentinels, service,
db and user; malformed ones refused in one line; plain URLs stay plain clients."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from common.redis_connect import SentinelTarget, is_sentinel_url, parse_sentinel_url, sync_client


def test_a_sentinel_url_names_its_sentinels_service_db_and_user():
    url = "redis+sentinel://gateway@s0:26379,s1:26380,s2/inflight/2"
    assert is_sentinel_url(url) and not is_sentinel_url("redis://h:6379/0")
    assert parse_sentinel_url(url) == SentinelTarget((("s0", 26379), ("s1", 26380), ("s2", 26379)),
                                                     "inflight", 2, "gateway", False)
    assert parse_sentinel_url("rediss+sentinel://h:1/m").tls


@pytest.mark.parametrize("url", ["redis+sentinel://h:1", "redis+sentinel:///m", "redis+sentinel://h:x/m",
                                 "redis+sentinel://u:pw@h:1/m", "redis+sentinel://h:1/m/x", "redis://h/0"])
def test_malformed_sentinel_urls_are_refused(url):
    with pytest.raises(ValueError):
        parse_sentinel_url(url)


def test_clients_of_both_kinds():
    client = sync_client("redis+sentinel://gateway@127.0.0.1:1/inflight/3", "pw")
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "inflight"
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["username"] == "gateway"
    assert pool.connection_kwargs["password"] == "pw"
    plain = sync_client("redis://127.0.0.1:1/0")
    assert isinstance(plain, redis.Redis) and not isinstance(plain.connection_pool, SentinelConnectionPool)
