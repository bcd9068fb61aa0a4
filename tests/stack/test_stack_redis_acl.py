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
