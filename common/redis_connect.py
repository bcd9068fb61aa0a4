"""Redis clients from one URL for the gateway, the worker and the CLI: a plain Redis
(``redis://``, ``rediss://``, ``unix://``) or a master found through Redis Sentinel.

Sentinel URL (the form several clients use; redis-py has no URL form of its own)::

    redis+sentinel://[user@]host1:26379[,host2:26379,...]/<service name>[/<db>]

e.g. ``redis+sentinel://gateway@sentinel-0:26379,sentinel-1:26379,sentinel-2:26379/inflight/0``.
The user and the password (``--redis-password-file``) are the Redis ACL user's, as with
``redis://``; the sentinels themselves are asked without a password (``sentinel_password``
for a caller that has one). ``rediss+sentinel://`` talks TLS to the master (not to the
sentinels).

redis-py's ``Sentinel.master_for`` client asks a sentinel for the master's address at each
new connection and drops connections to a master that became a replica, so after a failover
the next command (the clients here retry once on a connection error) reaches the new master.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed ``redis+sentinel://`` URL.

    Attributes:
        sentinels: (host, port) of each sentinel.
        service_name: the monitored master's name (``sentinel monitor <name> ...``).
        db: the database number.
        username: the Redis ACL user (None: the default user).
        tls: ``rediss+sentinel``: TLS to the master.
    """

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    tls: bool = False


def is_sentinel_url(url: str) -> bool:
    """True for a ``redis+sentinel://`` or ``rediss+sentinel://`` URL."""
    return url.split("://", 1)[0] in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse a Sentinel URL (module docstring).

    Raises:
        ValueError: not a Sentinel URL, no sentinel, a bad port, no service name or a bad db.
    """
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a redis+sentinel:// URL: {url!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if ":" in userinfo:
        raise ValueError("put the password in --redis-password-file, not in a redis+sentinel:// URL")
    sentinels = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "26379")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad sentinel port in {item!r}")
        sentinels.append((host, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2:
        raise ValueError(f"expected redis+sentinel://[user@]host:port[,host:port...]/<service name>[/<db>], got {url!r}")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"bad database number {path[1]!r} in {url!r}")
    return SentinelTarget(tuple(sentinels), unquote(path[0]), int(path[1]) if len(path) == 2 else 0,
                          unquote(userinfo) or None, parts.scheme == "rediss+sentinel")


def _master_kwargs(target: SentinelTarget, password: str | None, options: dict[str, Any]) -> dict[str, Any]:
    kwargs = {"db": target.db, **options}
    if target.username:
        kwargs["username"] = target.username
    if password:
        kwargs["password"] = password
    if target.tls:
        kwargs["ssl"] = True
    return kwargs


def _sentinel_kwargs(options: dict[str, Any], sentinel_password: str | None) -> dict[str, Any]:
    keep = {k: options[k] for k in ("socket_timeout", "socket_connect_timeout") if k in options}
    return {**keep, **({"password": sentinel_password} if sentinel_password else {})}


def async_client(url: str, password: str | None = None, sentinel_password: str | None = None,
                 **options: Any) -> redis.asyncio.Redis:
    """An asyncio client of ``url``: ``redis.asyncio.Redis.from_url`` for a plain URL, the
    master of a Sentinel URL otherwise. ``options`` are redis-py connection options
    (timeouts, ``retry``, ``max_connections``, ...).

    Raises:
        ValueError: a malformed Sentinel URL.
    """
    if not is_sentinel_url(url):
        return redis.asyncio.Redis.from_url(url, **({"password": password} if password else {}), **options)
    target = parse_sentinel_url(url)
    sentinel = AsyncSentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(options, sentinel_password))
    return sentinel.master_for(target.service_name, **_master_kwargs(target, password, options))


def sync_client(url: str, password: str | None = None, sentinel_password: str | None = None,
                **options: Any) -> redis.Redis:
    """As :func:`async_client`, a blocking client (``inflight keys``).

    Raises:
        ValueError: a malformed Sentinel URL.
    """
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **({"password": password} if password else {}), **options)
    target = parse_sentinel_url(url)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(options, sentinel_password))
    return sentinel.master_for(target.service_name, **_master_kwargs(target, password, options))
