"""Command-line options shared by more than one ``inflight`` command (the worker's and the
gateway's credentials files and tracing), each declared here once as ``(flags, argparse
keyword arguments)``, with the helpers that read what they name. No torch, no worker import:
the gateway image has neither."""

from __future__ import annotations

import argparse
import os
from typing import Any

#: An option's declaration: its flags and the keyword arguments of ``ArgumentParser.add_argument``.
OptionSpec = tuple[tuple[str, ...], dict[str, Any]]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_password_option(role: str) -> OptionSpec:
    """``--redis-password-file`` for the Redis ACL user ``role`` ("worker", "gateway", "admin")."""
    return (("--redis-password-file",),
            dict(default=None, metavar="PATH",
                 help=f"file holding the password of the Redis ACL user named in --redis-url (redis://{role}@host:6379/0; "
                      "default: $INFLIGHT_REDIS_PASSWORD_FILE, else the URL's password or none)"))


LINK_SECRET_OPTION: OptionSpec = (
    ("--link-secret-file",),
    dict(default=None, metavar="PATH",
         help="file holding the shared secret of the worker link (default: $INFLIGHT_LINK_SECRET_FILE, "
              "else $INFLIGHT_LINK_SECRET; none: the gateway accepts any link and warns)"))

TRACING_OPTION: OptionSpec = (
    ("--otlp-traces-endpoint",),
    dict(default=None, metavar="URL",
         help="export OpenTelemetry traces over OTLP to URL (vLLM's flag; the same as "
              "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Off by default; the OTEL_* variables "
              "(OTEL_TRACES_EXPORTER, OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, ...) work too"))


def add_option(parser: argparse.ArgumentParser, spec: OptionSpec) -> None:
    """Add one declared option to ``parser``."""
    flags, kwargs = spec
    parser.add_argument(*flags, **kwargs)


def link_secret_from(path: str | None) -> str | None:
    """The link secret of ``--link-secret-file`` (``path``), ``INFLIGHT_LINK_SECRET_FILE`` or
    ``INFLIGHT_LINK_SECRET`` (None when none is set).

    Raises:
        ValueError: an unreadable or empty file (one line for the caller to print).
    """
    from common.credentials import link_secret

    try:
        return link_secret(path, os.environ)
    except OSError as exc:
        raise ValueError(f"cannot read the link secret: {exc}") from exc


def redis_password_from(path: str | None) -> str | None:
    """The password of ``--redis-password-file`` (``path``) or ``INFLIGHT_REDIS_PASSWORD_FILE``
    (None: the URL's, or none).

    Raises:
        ValueError: an unreadable or empty file (one line for the caller to print).
    """
    from common.credentials import redis_password

    try:
        return redis_password(path, os.environ)
    except OSError as exc:
        raise ValueError(f"cannot read the Redis password: {exc}") from exc


def check_redis_url(url: str) -> None:
    """Raise ValueError now for a malformed ``redis+sentinel://`` URL (common/redis_connect.py)."""
    from common.redis_connect import is_sentinel_url, parse_sentinel_url

    if is_sentinel_url(url):
        parse_sentinel_url(url)
