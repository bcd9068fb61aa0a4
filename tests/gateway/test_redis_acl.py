"""Redis with least privilege (common/redis_acl.py, deploy/redis/users.acl), against a real
redis-server >= 7 loaded with the shipped ACL: each role's denials (NOPERM), and a real
gateway and a real worker service (fake-runner engine) serving a request end to end,
each with its own user, with the key created by the admin user."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis
import redis.asyncio

from common.redis_acl import ROLES, render_acl, template
from gateway import keys
from gateway.admission.ratelimit import window_usage
from tests.gateway.fake_worker import MODEL
from tests.gateway.harness import start_gateway
from tests.helpers.redis_server import redis_server_binary, start_redis

ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"{role}-pw-0123456789" for role in ROLES}


def _redis_major() -> int:
    out = subprocess.run([redis_server_binary(), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"v=(\d+)\.", out)
    return int(found.group(1)) if found else 0


pytestmark = pytest.mark.skipif(_redis_major() < 7, reason="ACL selectors need redis-server >= 7")


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    path = tmp_path_factory.mktemp("acl") / "users.acl"
    path.write_text(render_acl(PASSWORDS))
    server = start_redis(acl_file=str(path))
    yield server
    server.stop()


def _url(server, role: str | None) -> str:
    return f"redis://{role}@127.0.0.1:{server.port}/0" if role else f"redis://127.0.0.1:{server.port}/0"


def _client(server, role: str | None) -> redis.Redis:
    return redis.Redis.from_url(_url(server, role), password=PASSWORDS.get(role) if role else None)


def test_the_shipped_acl_file_is_the_rendered_source_of_truth():
    assert (ROOT / "deploy/redis/users.acl").read_text() == template()


DENIED = {
    "worker": [
        ("HGETALL", "inflight:keys:hash:abc"),             # read an API key record
        ("GET", "inflight:keys:id:k1"),
        ("ZADD", "inflight:rl:{k1}:req", "1", "m"),          # touch a rate-limit window
        ("ZCARD", "inflight:rl:{k1}:req"),
        ("XADD", "inflight:requests:0", "*", "req", "x"),  # enqueue a request of its own
        ("SET", "inflight:keys:id:k1", "x"),
        ("SET", "inflight:kv:w1:load", "x"),                   # only the commands its KV events use
        ("GET", "inflight:responses:k1:resp_1"),               # a key's stored responses
        ("EVALSHA", "0" * 40, "0"),
        ("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*"), ("SCAN", "0"),
    ],
    "gateway": [
        ("XACK", "inflight:requests:1", "inflight-workers", "1-1"),
        ("XAUTOCLAIM", "inflight:requests:1", "inflight-workers", "c", "0", "0"),
        ("XREADGROUP", "GROUP", "inflight-workers", "c", "STREAMS", "inflight:requests:1", ">"),
        ("XGROUP", "CREATE", "inflight:requests:1", "g2", "0", "MKSTREAM"),
        ("XCLAIM", "inflight:requests:1", "inflight-workers", "c", "0", "1-1"),
        ("HSET", "inflight:keys:hash:abc", "revoked", "0"),  # forge or un-revoke a key
        ("SADD", "inflight:keys:ids", "k9"),
        ("SET", "inflight:workers:fake", "{}"),               # fake a worker heartbeat
        ("XADD", "inflight:dead:1", "*", "req", "x"),
        ("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "SET", "appendonly", "no"), ("SHUTDOWN", "NOSAVE"),
        ("EVAL", "return 1", "0"),
        ("SADD", "inflight:kv:w1:blocks", "x"),                # fake a worker's prefix cache
        ("HSET", "inflight:kv:w1:load", "waiting", "0"),        # or its load
        ("SADD", "inflight:kv:workers", "w9"),
    ],
    "admin": [
        ("XADD", "inflight:requests:0", "*", "req", "x"),
        ("ZADD", "inflight:rl:{k1}:req", "1", "m"),           # window usage is read-only
        ("DEL", "inflight:rl:{k1}:req"),
        ("FLUSHALL",),
    ],
    None: [("GET", "x"), ("HGETALL", "inflight:keys:hash:abc"), ("XLEN", "inflight:requests:1")],
}


@pytest.mark.parametrize("role,command", [(r, c) for r, cmds in DENIED.items() for c in cmds],
                         ids=lambda v: v if isinstance(v, str) or v is None else " ".join(v[:2]))
def test_each_role_is_refused_what_it_does_not_need(acl_redis, role, command):
    client = _client(acl_redis, role)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    finally:
        client.close()


def test_the_default_user_may_only_ping_and_a_wrong_password_is_refused(acl_redis):
    assert _client(acl_redis, None).ping()
    wrong = redis.Redis.from_url(_url(acl_redis, "gateway"), password="nope")
    with pytest.raises(redis.exceptions.AuthenticationError):
        wrong.ping()
    stolen = redis.Redis.from_url(_url(acl_redis, "admin"), password=PASSWORDS["gateway"])
    with pytest.raises(redis.exceptions.AuthenticationError):
        stolen.ping()


def _run_worker(url: str, password: str, link_secret: str, stop: threading.Event) -> threading.Thread:
    from tests.worker.engine_helpers import make_engine
    from worker.serve.main import redis_client
    from worker.serve.service import WorkerService
    from worker.serve.settings import WorkerSettings

    def main() -> None:
        async def serve() -> None:
            client = redis_client(url, password)
            settings = WorkerSettings(redis_url=url, worker_id="acl-w1", poll_ms=20, health_port=0,
                                      grpc_health_port=0, link_secret=link_secret, served_model_name=(MODEL,))
            service = WorkerService(settings, make_engine(num_blocks=64, block_size=4), client, "fake")
            task = asyncio.create_task(service.run())
            beat_key = "inflight:workers:acl-w1"
            while not stop.is_set():
                await client.set(beat_key, json.dumps({"model": MODEL}), ex=10)  # the heartbeat, with the worker's user
                await asyncio.sleep(0.1)
            await client.delete(beat_key)
            service.stop()
            await asyncio.wait_for(task, 10)
            await client.aclose()
        asyncio.run(serve())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread


def _relay_commands_allowed(url: str, password: str) -> None:
    """The gateway user may run a relay's reads and the takeover script on a journal
    (gateway/stream_relay.py; a stream nobody owns, whose record is gone here)."""
    from gateway.stream_journal import StreamJournal

    async def check() -> None:
        client = redis.asyncio.Redis.from_url(url, password=password)
        try:
            journal = StreamJournal(client, "req-acl", 60)
            assert await client.xread({journal.events_key: "0-0"}, count=1, block=10) == []
            assert not await client.exists(journal.owner_key)
            async with client.pipeline(transaction=True) as pipe:  # the relay's look: MULTI EXISTS XREAD
                pipe.exists(journal.owner_key)
                pipe.xread({journal.events_key: "0-0"}, count=64)
                owned, found = await pipe.execute()
            assert not owned and not found
            assert (await journal.take_over("0-0", 1)).status == "gone"
        finally:
            await client.aclose()
    asyncio.run(check())


def test_gateway_worker_and_admin_work_end_to_end_with_their_own_users(acl_redis):
    admin = _client(acl_redis, "admin")
    key_id, plaintext = keys.create_key(admin, "tenant-acl", "acl test", requests_per_min=100)
    secret = "acl-link-secret-0123456789"
    gw = start_gateway(_url(acl_redis, "gateway"), redis_password=PASSWORDS["gateway"], link_secret=secret,
                       require_worker=True)
    stop = threading.Event()
    worker = _run_worker(_url(acl_redis, "worker"), PASSWORDS["worker"], secret, stop)
    try:
        deadline = time.monotonic() + 10
        while httpx.get(f"{gw.rest_url}/ready", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, "the gateway never saw the worker's heartbeat"
            time.sleep(0.1)
        # /v1/responses stores the response (SET EX), reads it back (GET) and deletes it (DEL)
        auth = {"Authorization": f"Bearer {plaintext}"}
        resp = httpx.post(f"{gw.rest_url}/v1/responses", timeout=30, headers=auth,
                          json={"model": "test-model", "input": "hello", "max_output_tokens": 3})
        assert resp.status_code == 200, resp.text
        stored = f"{gw.rest_url}/v1/responses/{resp.json()['id']}"
        assert httpx.get(stored, headers=auth, timeout=10).json()["id"] == resp.json()["id"]
        assert httpx.delete(stored, headers=auth, timeout=10).status_code == 200
        for stream in (False, True):
            resp = httpx.post(f"{gw.rest_url}/v1/completions", timeout=30,
                              headers={"Authorization": f"Bearer {plaintext}"},
                              json={"model": "test-model", "prompt": "hello", "max_tokens": 6,
                                    "temperature": 0, "ignore_eos": True, "stream": stream})
            assert resp.status_code == 200, resp.text
            if not stream:
                assert resp.json()["usage"]["completion_tokens"] == 6
            else:
                assert resp.text.rstrip().endswith("data: [DONE]")
                # its journal (MULTI, the fenced append's and the release's EVALSHA) was written:
                # a resume replays it (MULTI: EXISTS, HGETALL, XRANGE)
                # (at the last delta's id: the finish chunk's own, <offset>.1, has nothing after it)
                last_id = [line[4:] for line in resp.text.splitlines() if line.startswith("id: ") and "." not in line][-1]
                again = httpx.post(f"{gw.rest_url}/v1/completions", timeout=30,
                                   headers={"Authorization": f"Bearer {plaintext}", "Last-Event-ID": last_id},
                                   json={"model": "test-model", "prompt": "hello", "max_tokens": 6,
                                         "temperature": 0, "ignore_eos": True, "stream": True})
                assert again.status_code == 200 and '"finish_reason": "length"' in again.text, again.text
        _relay_commands_allowed(_url(acl_redis, "gateway"), PASSWORDS["gateway"])
        # the admin user reads the windows the gateway's scripts wrote, and manages the key
        assert window_usage(admin, key_id)["requests"] == 4  # the resume is admitted too
        assert [r.key_id for r in keys.list_keys(admin)] == [key_id]
        assert keys.revoke_key(admin, key_id)
        resp = httpx.post(f"{gw.rest_url}/v1/completions", timeout=10,
                          headers={"Authorization": f"Bearer {plaintext}"},
                          json={"model": "test-model", "prompt": "hello", "max_tokens": 2})
        assert resp.status_code == 401
    finally:
        stop.set()
        worker.join(15)
        gw.stop()
        admin.close()
