"""Names of the Redis streams and keys the gateway and the worker share (docs/CONTRACTS.md,
"Redis"), in one place so the producer, the consumers and the ACL (common/redis_acl.py)
cannot drift apart.

* ``inflight:requests:{model}:{priority}``: the shared request stream of one model (its id,
  the first of its workers' ``--served-model-name``) and priority class, read by every
  worker of that model (consumer group ``inflight-workers``). A request naming an alias
  or a LoRA adapter goes to its base model's stream.
* ``inflight:requests:{model}:{priority}:w:{worker_id}``: a worker's own stream, where the
  gateway's KV-aware router puts requests whose prompt prefix that worker holds; the
  worker reads it first, and once the worker is gone the other workers of its model take
  it over.
* ``inflight:workers:{worker_id}``: the worker's heartbeat (TTL), a JSON object saying what
  it serves (common/served_model.py: model id, aliases, context length, tokenizer
  fingerprint, task, adapters).
* ``inflight:kv:{worker_id}:blocks``: the set of prefix-cache block hashes the worker
  holds (16 bytes each, common/block_hash.py), kept by its KV events.
* ``inflight:kv:{worker_id}:load``: a hash of the worker's load and block-hash settings,
  with a short TTL (no refresh: not routable).
* ``inflight:kv:workers:{model}``: the set of ids of the workers of one model that have
  own streams (the router's candidates; the takeover looks for dead ones there).
* ``inflight:rl:rejections:{unix_s // 10}``: the 429s of one 10-second bucket by reason,
  counted by every gateway for the fleet view (common/fleet.py).
* ``inflight:responses:{key_id}:{response_id}``: a stored ``/v1/responses`` response of
  one API key (JSON, with a TTL; gateway/responses_store.py); the key id in the name is
  what keeps one key from reading another's.
"""

from __future__ import annotations

GROUP = "inflight-workers"
STREAM_PREFIX = "inflight:requests:"
ROUTER_WORKERS_PREFIX = "inflight:kv:workers:"
HEARTBEAT_PREFIX = "inflight:workers:"


def stream_name(priority: int, model: str) -> str:
    """The shared request stream of model ``model`` (its id) in priority class ``priority``
    (0 = highest)."""
    return f"{STREAM_PREFIX}{model}:{priority}"


def worker_stream(priority: int, worker_id: str, model: str) -> str:
    """The own request stream of worker ``worker_id`` (serving ``model``) in priority class
    ``priority``."""
    return f"{STREAM_PREFIX}{model}:{priority}:w:{worker_id}"


def router_workers(model: str) -> str:
    """The set of ids of ``model``'s workers that have own streams."""
    return f"{ROUTER_WORKERS_PREFIX}{model}"


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
