"""Names of the Redis streams and keys the gateway and the worker share (docs/CONTRACTS.md,
"Redis"), in one place so the producer, the consumers and the ACL (common/redis_acl.py)
cannot drift apart.

* ``inflight:requests:{priority}``: the shared request stream of a priority class, read
  by every worker (consumer group ``inflight-workers``).
* ``inflight:requests:{priority}:w:{worker_id}``: a worker's own stream, where the
  gateway's KV-aware router puts requests whose prompt prefix that worker holds; the
  worker reads it first, and once the worker is gone the others take it over.
* ``inflight:workers:{worker_id}``: the worker's heartbeat (TTL).
* ``inflight:kv:{worker_id}:blocks``: the set of prefix-cache block hashes the worker
  holds (16 bytes each, common/block_hash.py), kept by its KV events.
* ``inflight:kv:{worker_id}:load``: a hash of the worker's load and block-hash settings,
  with a short TTL (no refresh: not routable).
* ``inflight:kv:workers``: the set of worker ids that have own streams (the takeover
  looks for dead ones there).
* ``inflight:rl:rejections:{unix_s // 10}``: the 429s of one 10-second bucket by reason,
  counted by every gateway for the fleet view (common/fleet.py).
* ``inflight:responses:{key_id}:{response_id}``: a stored ``/v1/responses`` response of
  one API key (JSON, with a TTL; gateway/responses_store.py); the key id in the name is
  what keeps one key from reading another's.
"""

from __future__ import annotations

GROUP = "inflight-workers"
STREAM_PREFIX = "inflight:requests:"
ROUTER_WORKERS = "inflight:kv:workers"
HEARTBEAT_PREFIX = "inflight:workers:"


def stream_name(priority: int) -> str:
    """The shared request stream of one priority class (0 = highest)."""
    return f"{STREAM_PREFIX}{priority}"


def worker_stream(priority: int, worker_id: str) -> str:
    """The own request stream of worker ``worker_id`` in priority class ``priority``."""
    return f"{STREAM_PREFIX}{priority}:w:{worker_id}"


def heartbeat_key(worker_id: str) -> str:
    """The heartbeat key of a worker (exists while it is ready and not draining)."""
    return f"{HEARTBEAT_PREFIX}{worker_id}"


def kv_blocks_key(worker_id: str) -> str:
    """The set of block hashes worker ``worker_id``'s prefix cache holds."""
    return f"inflight:kv:{worker_id}:blocks"


def kv_load_key(worker_id: str) -> str:
    """The hash of worker ``worker_id``'s load (running, waiting, free blocks, ...)."""
    return f"inflight:kv:{worker_id}:load"


RESPONSES_PREFIX = "inflight:responses:"


def response_key(key_id: str, response_id: str) -> str:
    """Where the stored response ``response_id`` of API key ``key_id`` lives."""
    return f"{RESPONSES_PREFIX}{key_id}:{response_id}"


def rejections_key(bucket: int) -> str:
    """The hash of one 10-second bucket's 429s by reason (``bucket`` = Unix seconds // 10)."""
    return f"inflight:rl:rejections:{bucket}"
