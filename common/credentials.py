"""Secrets from files or the environment, never from a command line (``ps`` shows those).

The link secret (workers authenticate to the gateway's link server) and the Redis
passwords come through here. A file's content is the secret, with surrounding
whitespace (a trailing newline) stripped.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Mapping

#: gRPC metadata key carrying the link secret on ``Link.Connect``.
LINK_SECRET_METADATA = "x-inflight-link-secret"
LINK_SECRET_ENV = "INFLIGHT_LINK_SECRET"
LINK_SECRET_FILE_ENV = "INFLIGHT_LINK_SECRET_FILE"
REDIS_PASSWORD_FILE_ENV = "INFLIGHT_REDIS_PASSWORD_FILE"


def read_secret_file(path: str | os.PathLike) -> str:
    """The secret stored in ``path``, stripped.

    Raises:
        ValueError: the file is empty, or holds characters that cannot travel as gRPC
            metadata or in a Redis AUTH (printable ASCII only).
        OSError: it cannot be read.
    """
    value = Path(path).read_text(encoding="utf-8").strip()
    if not value:
        raise ValueError(f"secret file {path} is empty")
    if not all(33 <= ord(c) < 127 for c in value):
        raise ValueError(f"secret file {path}: use printable ASCII without spaces")
    return value


def link_secret(secret_file: str | None, env: Mapping[str, str]) -> str | None:
    """The link secret: ``secret_file`` (``--link-secret-file``), else the file named by
    ``INFLIGHT_LINK_SECRET_FILE``, else ``INFLIGHT_LINK_SECRET``; None when none is set.

    Raises:
        ValueError, OSError: from :func:`read_secret_file`.
    """
    path = secret_file or env.get(LINK_SECRET_FILE_ENV)
    if path:
        return read_secret_file(path)
    value = (env.get(LINK_SECRET_ENV) or "").strip()
    return value or None


def redis_password(password_file: str | None, env: Mapping[str, str]) -> str | None:
    """The Redis password of ``password_file`` (``--redis-password-file``), else of the file
    named by ``INFLIGHT_REDIS_PASSWORD_FILE``; None when neither is set (then a password
    in the Redis URL, or none, is used). The user name goes in the URL
    (``redis://gateway@host:6379/0``).

    Raises:
        ValueError, OSError: from :func:`read_secret_file`.
    """
    path = password_file or env.get(REDIS_PASSWORD_FILE_ENV)
    return read_secret_file(path) if path else None


def write_secret_file(path: str | os.PathLike, value: str | None = None) -> str:
    """Write ``value`` (default: 32 random bytes, hex) to ``path`` with mode 0600,
    created so that it is never readable by others, even for a moment; returns it."""
    value = value or secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (value + "\n").encode())
    finally:
        os.close(fd)
    return value
