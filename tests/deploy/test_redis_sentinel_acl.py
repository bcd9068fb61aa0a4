"""The Sentinel variant's Redis users suffice: deploy/redis/sentinel.acl and redis-ha.sh
run for real (a master, a replica and one sentinel on loopback, as compose's profile
``sentinel`` and deploy/k8s-sentinel start them, ports aside).

* the template is what ``common.redis_acl`` renders (the one source of the ACL), and
  the users have exactly the permissions Redis's Sentinel docs list;
* the replica syncs from the master as the ACL user ``replication``;
* the sentinel, as the ACL user ``sentinel``, sees master and replica and carries out a
  failover (``SENTINEL FAILOVER``: REPLICAOF, CONFIG REWRITE, CLIENT KILL on both), after
  which the old master replicates from the new one with its own ``masterauth``;
* a wrong or empty password file stops redis-ha.sh with an error that never shows it,
  and no password is on any command line.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from common.redis_acl import ROLES, SENTINEL_ROLES, SENTINEL_RULES, sentinel_template
from tests.helpers.redis_server import free_port, redis_server_binary

ROOT = Path(__file__).resolve().parents[2]
REDIS_DIR = ROOT / "deploy" / "redis"
RENDER = REDIS_DIR / "render-acl.sh"
HA = REDIS_DIR / "redis-ha.sh"
PASSWORDS = {role: f"{role}-Pw\\\"_0123456789" for role in (*ROLES, *SENTINEL_ROLES)}  # \ and " quoted in CONF
NAME = "inflight"

pytestmark = pytest.mark.skipif(not (shutil.which("sh") and shutil.which("sha256sum")),
                                reason="needs sh and sha256sum (as in the redis:7-alpine image)")


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def test_the_template_is_common_redis_acl_and_the_documented_least_permissions():
    assert (REDIS_DIR / "sentinel.acl").read_text() == sentinel_template()
    # Redis docs, "High availability with Redis Sentinel" > "Redis Access Control List authentication".
    assert set(SENTINEL_RULES["replication"].split()) == {"resetkeys", "resetchannels", "-@all",
                                                         "+psync", "+replconf", "+ping"}
    assert set(SENTINEL_RULES["sentinel"].split()) == {
        "resetkeys", "allchannels", "-@all", "+multi", "+slaveof", "+ping", "+exec", "+subscribe",
        "+config|rewrite", "+role", "+publish", "+info", "+client|setname", "+client|kill", "+script|kill"}
    assert not any(w.startswith("~") or w.startswith("%") for rules in SENTINEL_RULES.values() for w in rules.split())


def _start(args: list[str], procs: list[subprocess.Popen]) -> None:
    procs.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))


@pytest.fixture()
def sentinel_set(tmp_path) -> Iterator[dict]:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for role, password in PASSWORDS.items():
        (secrets / role).write_text(f" {password}\n")
    pattern = f"{secrets}/%s"
    binary = redis_server_binary()
    ports = {"master": free_port(), "replica": free_port(), "sentinel": free_port()}
    procs: list[subprocess.Popen] = []
    try:
        for node in ("master", "replica"):
            folder = tmp_path / node
            folder.mkdir()
            master = "-" if node == "master" else f"127.0.0.1:{ports['master']}"
            _start(["sh", str(RENDER), pattern, str(folder / "users.acl"), str(REDIS_DIR / "users.acl"),
                    str(REDIS_DIR / "sentinel.acl"), "--", "sh", str(HA), "server", pattern,
                    str(folder / "ha.conf"), master, "--", binary, "--port", str(ports[node]),
                    "--bind", "127.0.0.1", "--dir", str(folder), "--save", "", "--appendonly", "no",
                    "--repl-diskless-sync-delay", "0",
                    "--aclfile", str(folder / "users.acl")], procs)
            if node == "master":
                _wait(lambda: redis.Redis(port=ports["master"]).ping(), "the master answers")
        replica = redis.Redis(port=ports["replica"], username="admin", password=PASSWORDS["admin"])
        _wait(lambda: replica.ping(), "the replica answers")
        folder = tmp_path / "sentinel"
        folder.mkdir()
        _start(["sh", str(HA), "sentinel", pattern, str(folder / "sentinel.conf"), f"127.0.0.1:{ports['master']}",
                NAME, "1", "--", binary, "--sentinel", "--port", str(ports["sentinel"]), "--bind", "127.0.0.1"],
               procs)
        yield {"ports": ports, "procs": procs, "tmp": tmp_path}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _role(port: int) -> str:
    info = redis.Redis(port=port, username="sentinel", password=PASSWORDS["sentinel"]).info("replication")
    return info["role"] if info["role"] == "master" else f"slave:{info['master_link_status']}"


def test_replica_and_sentinel_log_in_and_a_failover_completes(sentinel_set):
    ports = sentinel_set["ports"]
    _wait(lambda: _role(ports["replica"]) == "slave:up", "the replica syncs as the user replication")
    sentinel = redis.Redis(port=ports["sentinel"], decode_responses=True)
    _wait(lambda: [(r["flags"], r["master-link-status"]) for r in sentinel.sentinel_slaves(NAME)] == [("slave", "ok")],
          "the sentinel sees the replica in sync")
    master = sentinel.sentinel_master(NAME)
    assert master["port"] == ports["master"] and not master["is_sdown"] and not master["is_disconnected"]
    assert sentinel.execute_command("SENTINEL", "FAILOVER", NAME)
    _wait(lambda: sentinel.sentinel_master(NAME)["port"] == ports["replica"], "the sentinel promotes the replica")
    _wait(lambda: _role(ports["replica"]) == "master", "the replica is the master")
    _wait(lambda: _role(ports["master"]) == "slave:up", "the old master replicates with its masterauth")
    # The gateway's user works on the new master; the sentinel user reads no key.
    new = redis.Redis(port=ports["replica"], username="gateway", password=PASSWORDS["gateway"])
    assert new.xadd("inflight:requests:normal", {"a": "1"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis(port=ports["replica"], username="sentinel", password=PASSWORDS["sentinel"]).get("inflight:x")
    conf = (sentinel_set["tmp"] / "sentinel" / "sentinel.conf")
    assert conf.stat().st_mode & 0o077 == 0
    for proc in sentinel_set["procs"]:
        assert not any(p in " ".join(map(str, proc.args)) for p in PASSWORDS.values())


@pytest.mark.parametrize("content,message", [("", "is empty"), ("two words", "printable ASCII"),
                                             ("caf\u00e9", "printable ASCII")])
def test_a_bad_password_file_stops_redis_ha_and_is_never_shown(tmp_path, content, message):
    (tmp_path / "replication").write_text(content)
    proc = subprocess.run(["sh", str(HA), "server", f"{tmp_path}/%s", str(tmp_path / "ha.conf"), "-", "--", "true"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and message in proc.stderr and str(tmp_path / "replication") in proc.stderr
    assert not content or content not in proc.stderr
    assert not (tmp_path / "ha.conf").exists()
