"""`inflight up`'s embedded Redis runs with the ACL users, as compose and Kubernetes do: one
real stack (the real model, worker and gateway processes, nginx when installed) whose
Redis refuses a client without a password, whose worker user cannot read the API key the
stack created with the admin user, and which still answers a request end to end; no
password is on any of its command lines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from common.credentials import read_secret_file
from gateway import keys
from stack.clients import rest_chat_stream
from stack.stack import Stack, StackSettings
from tests.helpers.redis_server import free_port


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("acl-stack")
    settings = StackSettings(
        run_dir=run_dir, rest_port=free_port(), grpc_port=free_port(), link_port=free_port(),
        worker_health_port=free_port(), worker_grpc_health_port=free_port(),
        edge_rest_port=free_port(), edge_grpc_port=free_port(),
        worker_args=("--device", "cpu", "--dtype", "float32", "--kv-cache-mib", "64", "--warmup-tokens", "16"))
    with Stack(settings) as s:
        yield s


def _client(stack, role: str | None) -> redis.Redis:
    password = read_secret_file(stack.settings.run_dir / "redis-passwords" / role) if role else None
    return redis.Redis.from_url(stack._redis.url(role), password=password)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.timeout(300)
def test_the_embedded_redis_has_acl_users_and_the_stack_serves(stack):
    ends = stack.endpoints()
    assert ends["redis"].startswith("unix://admin@") and ends["redis_password_file"]
    key = stack.create_key(tenant="acl", name="tests")  # through `inflight keys` as the admin user

    nobody, worker, admin = _client(stack, None), _client(stack, "worker"), _client(stack, "admin")
    assert nobody.ping()
    for command in (("GET", "inflight:keys:ids"), ("XLEN", "inflight:requests:1")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            nobody.execute_command(*command)
    record = f"inflight:keys:hash:{keys.hash_key(key)}"
    assert admin.hgetall(record)  # the key is there ...
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.hgetall(record)  # ... and the worker cannot read it

    result = asyncio.run(rest_chat_stream(ends["rest"], key, "What is the capital of France?", max_tokens=8))
    assert result.error is None and result.text and result.completion_tokens > 0

    passwords = [read_secret_file(stack.settings.run_dir / "redis-passwords" / r) for r in ("gateway", "worker", "admin")]
    worker_cmd, gateway_cmd = _cmdline(stack.pid("worker")), _cmdline(stack.pid("gateway"))
    assert "unix://worker@" in worker_cmd and "--redis-password-file" in worker_cmd
    assert "unix://gateway@" in gateway_cmd and "--redis-password-file" in gateway_cmd
    for cmd in (worker_cmd, gateway_cmd, _cmdline(stack._redis.pid)):
        assert not any(p in cmd for p in passwords)
    for client in (nobody, worker, admin):
        client.close()


@pytest.mark.timeout(120)
def test_the_fleet_view_works_with_the_admin_and_gateway_users(stack):
    """`inflight status` as the admin user and GET /fleet as the gateway's user read the same
    fleet, with the 429 the gateway user recorded; the ACL allows what common/fleet.py calls."""
    import json
    import subprocess
    import sys

    import httpx

    ends = stack.endpoints()
    limited = stack.create_key(tenant="acl", name="rpm1")
    keys.set_limits(_client(stack, "admin"), _key_id(stack, limited), requests_per_min=1)
    body = {"prompt": "Hi", "max_tokens": 1}
    auth = {"Authorization": f"Bearer {limited}"}
    assert httpx.post(f"{ends['rest']}/v1/completions", json=body, headers=auth, timeout=60).status_code == 200
    assert httpx.post(f"{ends['rest']}/v1/completions", json=body, headers=auth, timeout=60).status_code == 429

    out = subprocess.run([sys.executable, "-m", "inflight.cli", "status", "--json", "--redis-url", ends["redis"],
                          "--redis-password-file", ends["redis_password_file"]], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    assert len(view["workers"]) == 1 and view["workers"][0]["source"] == "metrics"
    assert view["rejections_last_minute"] == {"key_rate": 1}
    admin_key = stack.create_key(tenant="acl", name="admin", admin=True)
    page = httpx.get(f"{ends['rest']}/fleet", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
    assert page.status_code == 200, page.text
    assert page.json()["rejections_last_minute"] == {"key_rate": 1}
    assert [w["worker_id"] for w in page.json()["workers"]] == [view["workers"][0]["worker_id"]]


def _key_id(stack, plaintext: str) -> str:
    raw = _client(stack, "admin").hgetall(f"inflight:keys:hash:{keys.hash_key(plaintext)}")
    return raw[b"key_id"].decode()
