"""Command-line options shared by more than one ``inflight`` command (the worker's and the
gateway's credentials files and tracing), each declared here once as ``(flags, argparse
keyword arguments)``, with the helpers that read what they name. No torch, no worker import:
the gateway image has neither."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping

#: An option's declaration: its flags and the keyword arguments of ``ArgumentParser.add_argument``.
OptionSpec = tuple[tuple[str, ...], dict[str, Any]]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
#: The environment variable ``inflight keys`` and ``inflight status`` read when ``--redis-url`` is absent.
REDIS_URL_ENV = "INFLIGHT_REDIS_URL"

#: ``--redis-url`` of ``inflight keys`` and ``inflight status``: no default of its own (see :func:`admin_redis_url`).
ADMIN_REDIS_URL_OPTION: OptionSpec = (
    ("--redis-url",),
    dict(default=None, metavar="URL",
         help=f"the stack's Redis as its admin user: the 'redis' URL that `inflight up` printed "
              f"(default: ${REDIS_URL_ENV}, else {DEFAULT_REDIS_URL}, this machine's own Redis, said on stderr)"))


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


def admin_redis_url(given: str | None, environ: Mapping[str, str], command: str) -> str:
    """The Redis URL of ``inflight keys``/``status``: ``--redis-url`` (``given``), else
    ``INFLIGHT_REDIS_URL``, else :data:`DEFAULT_REDIS_URL`, which is said in one line on stderr
    (a user's key made there did nothing on the stack, whose Redis is another)."""
    if given:
        return given
    if environ.get(REDIS_URL_ENV, "").strip():
        return environ[REDIS_URL_ENV].strip()
    print(f"{command}: using {DEFAULT_REDIS_URL}, this machine's own Redis (no --redis-url, no ${REDIS_URL_ENV}); "
          "a stack started by `inflight up` has its own: the 'redis' URL it printed", file=sys.stderr)
    return DEFAULT_REDIS_URL


def unreachable_redis_hint() -> str:
    """How to point ``inflight keys``/``status`` at the right Redis, for a one-line error."""
    return f"pass the stack's with --redis-url URL or ${REDIS_URL_ENV} (the 'redis' URL that `inflight up` printed)"


def check_redis_url(url: str) -> None:
    """Raise ValueError now for a malformed ``redis+sentinel://`` URL (common/redis_connect.py)."""
    from common.redis_connect import is_sentinel_url, parse_sentinel_url

    if is_sentinel_url(url):
        parse_sentinel_url(url)
