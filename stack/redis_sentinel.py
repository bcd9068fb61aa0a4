"""A Redis Sentinel set on this machine: a master, one replica and three sentinels (quorum 2),
each a ``redis-server`` process (``--sentinel`` mode for the sentinels; the binary of
:func:`stack.embedded_redis.server_binary`) on free loopback ports in one temporary directory.
Used by the Sentinel failover tests and by the chaos soak (``bench/chaos.py``).

:meth:`SentinelSet.kill_master` SIGKILLs the master; the sentinels then promote the replica
after ``down_after_ms`` (Redis docs, "High availability with Redis Sentinel").
:meth:`SentinelSet.restart_killed` starts the killed server again on its port; the sentinels
turn it into a replica of the new master. No ACL: the default user has every right, so this
set is for one machine's tests and benchmarks only.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from stack.embedded_redis import server_binary

SERVICE = "inflight"
_COMMON = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([server_binary()[0], *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


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
    """Ports: ``master_port`` (the first master), ``replica_port``, ``sentinel_ports``;
    ``procs``: the processes by name (``master``, ``replica``, ``sentinel-0`` .. ``sentinel-2``;
    "master" and "replica" name the first roles, whatever they are now)."""

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
        """The master as the first sentinel that answers names it.

        Raises:
            RuntimeError: no sentinel answers.
        """
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

    def name_of(self, port: int) -> str:
        """``master`` or ``replica``: the process listening on ``port``."""
        return "master" if port == self.master_port else "replica"

    def kill_master(self) -> int:
        """SIGKILL the current master (no shutdown, no save); returns its port."""
        _, port = self.master_address()
        proc = self.procs[self.name_of(port)]
        proc.kill()
        proc.wait(5)
        return port

    def wait_failover(self, old_port: int, timeout_s: float = 20.0) -> float:
        """Wait until the sentinels name another master that answers; returns the seconds it took.

        Raises:
            RuntimeError: no failover within ``timeout_s``.
        """
        started = time.monotonic()
        _wait(lambda: self.master_address()[1] != old_port and self.master().ping(), timeout_s, "failover")
        return time.monotonic() - started

    def restart_killed(self, port: int) -> None:
        """Start the server of ``port`` again (empty); the sentinels make it a replica of the
        current master (it announces itself and they reconfigure it)."""
        name = self.name_of(port)
        (Path(self.workdir.name) / name).mkdir(exist_ok=True)
        self.procs[name] = _spawn(["--port", str(port), "--dir", str(Path(self.workdir.name) / name), *_COMMON])

    def replicated(self) -> bool:
        """True when the current master has a replica whose link is up."""
        info = self.master().info("replication")
        return info.get("connected_slaves", 0) >= 1 and info.get("slave0", {}).get("state") == "online"

    def pids(self) -> dict[str, int]:
        """Process id of every running server and sentinel, by name."""
        return {name: p.pid for name, p in self.procs.items() if p.poll() is None}

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
        for name, port, extra in (("master", s.master_port, []),
                                  ("replica", s.replica_port, ["--replicaof", "127.0.0.1", str(s.master_port)])):
            (root / name).mkdir()
            s.procs[name] = _spawn(["--port", str(port), "--dir", str(root / name), *_COMMON, *extra])
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
