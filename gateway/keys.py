"""API keys: created once, stored hashed in Redis, looked up by hash.

Redis layout (owned here, see docs/CONTRACTS.md):

* ``inflight:keys:hash:{sha256}`` — hash: the :class:`KeyRecord` fields + ``key_hash``.
* ``inflight:keys:id:{key_id}`` — string: the sha256 of that key (for revoke/list).
* ``inflight:keys:ids`` — set of every key id.

The plaintext key (``sk-inflight-…``) is shown once by :func:`create_key` and
never stored. Sync functions take a ``redis.Redis`` (the CLI); the gateway uses
:func:`authenticate_async` with a ``redis.asyncio.Redis``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import asdict, dataclass, fields

import redis
import redis.asyncio

from gateway.errors import AuthenticationError, redis_unavailable

KEY_PREFIX = "sk-inflight-"
_HASH_KEY = "inflight:keys:hash:{}"
_ID_KEY = "inflight:keys:id:{}"
_IDS_KEY = "inflight:keys:ids"
LOWEST_PRIORITY = 2  # priority classes are 0 (highest) .. 2; workers read only those streams


def check_priority(value: int) -> int:
    """``value`` as a priority class (0 = highest .. :data:`LOWEST_PRIORITY`).

    Raises:
        ValueError: when it is outside that range (no worker reads such a stream).
    """
    if not 0 <= int(value) <= LOWEST_PRIORITY:
        raise ValueError(f"priority must be 0 to {LOWEST_PRIORITY} (0 = highest), got {value}")
    return int(value)


@dataclass(frozen=True)
class ModelLimits:
    """A key's limits for one model, beside its own (0 = none): sliding windows of 60 s and
    the in-flight cap, checked in the same admission script as the key's, so exact across
    gateway replicas (gateway/admission/admit.lua).

    Attributes:
        requests_per_min: requests to this model / 60 s.
        tokens_per_min: tokens (prompt + max_tokens) to this model / 60 s.
        max_inflight: requests to this model queued or running at once.
    """

    requests_per_min: int = 0
    tokens_per_min: int = 0
    max_inflight: int = 0


MODEL_LIMIT_FIELDS = ("requests_per_min", "tokens_per_min", "max_inflight")


@dataclass(frozen=True)
class KeyRecord:
    """What a key is allowed to do. Limits of 0 mean "no per-key limit".

    Attributes:
        key_id: public id (``key_…``), safe to log; never the key itself.
        tenant: the account the key bills to (fair-share scheduling unit).
        name: a label chosen by the operator.
        priority: priority class (0 = highest, 1 = default, 2 = low); requests may
            ask for a lower priority, never a higher one.
        requests_per_min: sliding-window request limit (requests / 60 s).
        tokens_per_min: sliding-window token limit (prompt + max_tokens per 60 s).
        max_inflight: requests of this key queued or running at once.
        max_max_tokens: the largest ``max_tokens`` this key may ask for (tokens).
        max_prompt_tokens: the longest prompt this key may send (tokens).
        created_unix_s: creation time, seconds since the epoch.
        revoked: a revoked key is refused (401).
        admin: the key may also read the fleet view (``GET /fleet``, the web page's fleet tab).
        models: the model names (served names, aliases or adapters) this key may use; empty =
            every model. Any other model is a 404 ``model_not_found``, as OpenAI answers for a
            model an organization cannot use.
        model_limits: ``(model, ModelLimits)`` pairs: the key's limits for that model, beside
            its own (``inflight keys set --model M``).
    """

    key_id: str
    tenant: str
    name: str = ""
    priority: int = 1
    requests_per_min: int = 0
    tokens_per_min: int = 0
    max_inflight: int = 0
    max_max_tokens: int = 0
    max_prompt_tokens: int = 0
    created_unix_s: float = 0.0
    revoked: bool = False
    admin: bool = False
    models: tuple[str, ...] = ()
    model_limits: tuple[tuple[str, ModelLimits], ...] = ()

    def may_use(self, *names: str) -> bool:
        """Whether this key may use a model known by any of ``names`` (the name a request
        sent, its canonical id); True for a key without a model list."""
        return not self.models or any(n in self.models for n in names if n)

    def limits_for_model(self, model: str) -> ModelLimits | None:
        """This key's limits for ``model``, or None when it has none."""
        return next((limits for name, limits in self.model_limits if name == model), None)


_LIMIT_FIELDS = ("priority", "requests_per_min", "tokens_per_min", "max_inflight",
                 "max_max_tokens", "max_prompt_tokens")


def hash_key(plaintext: str) -> str:
    """Hex SHA-256 of a presented key (what Redis stores)."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def _encode_models(models: tuple[str, ...]) -> str:
    return json.dumps(list(models))


def _encode_model_limits(pairs: tuple[tuple[str, ModelLimits], ...]) -> str:
    return json.dumps({name: asdict(limits) for name, limits in pairs}, sort_keys=True)


def _decode_model_limits(text: str) -> tuple[tuple[str, ModelLimits], ...]:
    return tuple((name, ModelLimits(**{k: int(v) for k, v in limits.items() if k in MODEL_LIMIT_FIELDS}))
                 for name, limits in sorted(json.loads(text or "{}").items()))


def _encode(record: KeyRecord, key_hash: str) -> dict[str, str]:
    out = {k: str(int(v) if isinstance(v, bool) else v) for k, v in asdict(record).items()
           if k not in ("models", "model_limits")}
    out["models"] = _encode_models(record.models)
    out["model_limits"] = _encode_model_limits(record.model_limits)
    out["key_hash"] = key_hash
    return out


def _decode(raw: dict) -> tuple[KeyRecord, str]:
    data = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}
    kwargs: dict[str, object] = {}
    for f in fields(KeyRecord):
        if f.name not in data:
            continue
        value = data[f.name]
        if f.name in ("revoked", "admin"):
            kwargs[f.name] = value == "1"
        elif f.name == "created_unix_s":
            kwargs[f.name] = float(value)
        elif f.name == "models":
            kwargs[f.name] = tuple(json.loads(value or "[]"))
        elif f.name == "model_limits":
            kwargs[f.name] = _decode_model_limits(value)
        elif f.name in _LIMIT_FIELDS:
            kwargs[f.name] = int(value)
        else:
            kwargs[f.name] = value
    return KeyRecord(**kwargs), data.get("key_hash", "")


def _check_values(limits: dict) -> None:
    """Raises ValueError on a negative limit or an out-of-range priority."""
    if "priority" in limits:
        check_priority(limits["priority"])
    if any(int(v) < 0 for v in limits.values()):
        raise ValueError("limits must be >= 0")


def create_key(client: redis.Redis, tenant: str, name: str = "", admin: bool = False,
               models: tuple[str, ...] = (), **limits: int) -> tuple[str, str]:
    """Create an API key for ``tenant``; returns ``(key_id, plaintext_key)``. An ``admin`` key
    may also read the fleet view (:attr:`KeyRecord.admin`); ``models`` limits the key to
    those models (:attr:`KeyRecord.models`; empty = all).

    ``limits`` may set any of: priority, requests_per_min, tokens_per_min,
    max_inflight, max_max_tokens, max_prompt_tokens (see :class:`KeyRecord`).
    The plaintext is returned once and never stored.

    Raises:
        ValueError: on an unknown limit name, a negative limit, a priority outside 0 to
            :data:`LOWEST_PRIORITY` or an empty tenant.
        redis.RedisError: when Redis fails.
    """
    unknown = set(limits) - set(_LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"unknown key limits: {sorted(unknown)}")
    _check_values(limits)
    if not tenant:
        raise ValueError("tenant must not be empty")
    key_id = "key_" + secrets.token_hex(8)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    record = KeyRecord(key_id=key_id, tenant=tenant, name=name, created_unix_s=time.time(), admin=admin,
                       models=tuple(models), **{k: int(v) for k, v in limits.items()})
    digest = hash_key(plaintext)
    pipe = client.pipeline(transaction=True)
    pipe.hset(_HASH_KEY.format(digest), mapping=_encode(record, digest))
    pipe.set(_ID_KEY.format(key_id), digest)
    pipe.sadd(_IDS_KEY, key_id)
    pipe.execute()
    return key_id, plaintext


def list_keys(client: redis.Redis) -> list[KeyRecord]:
    """Every key record (revoked ones included), sorted by creation time.

    Raises:
        redis.RedisError: when Redis fails.
    """
    records = []
    for key_id in client.smembers(_IDS_KEY):
        key_id = key_id.decode() if isinstance(key_id, bytes) else key_id
        digest = client.get(_ID_KEY.format(key_id))
        if digest is None:
            continue
        raw = client.hgetall(_HASH_KEY.format(digest.decode() if isinstance(digest, bytes) else digest))
        if raw:
            records.append(_decode(raw)[0])
    return sorted(records, key=lambda r: r.created_unix_s)


def revoke_key(client: redis.Redis, key_id: str) -> bool:
    """Mark ``key_id`` revoked; returns False when no such key exists.

    Raises:
        redis.RedisError: when Redis fails.
    """
    digest = client.get(_ID_KEY.format(key_id))
    if digest is None:
        return False
    digest = digest.decode() if isinstance(digest, bytes) else digest
    client.hset(_HASH_KEY.format(digest), "revoked", "1")
    return True


def get_key(client: redis.Redis, key_id: str) -> KeyRecord | None:
    """The record of ``key_id``, or None when no such key exists.

    Raises:
        redis.RedisError: when Redis fails.
    """
    digest = client.get(_ID_KEY.format(key_id))
    if digest is None:
        return None
    raw = client.hgetall(_HASH_KEY.format(digest.decode() if isinstance(digest, bytes) else digest))
    return _decode(raw)[0] if raw else None


def set_limits(client: redis.Redis, key_id: str, model: str = "", models: tuple[str, ...] | None = None,
               **limits: int) -> KeyRecord | None:
    """Change limits of an existing key (same names as :func:`create_key`; 0 = no limit).
    With ``model``, ``limits`` (requests_per_min, tokens_per_min, max_inflight only) are the
    key's limits for that model (:class:`ModelLimits`; all 0 removes them). ``models`` (not
    None) replaces the key's model list (empty = every model). Takes effect on the key's next
    request (gateways read the record per request). Returns the updated record, or None when
    no such key exists.

    Raises:
        ValueError: on an unknown limit name (or one that has no per-model form, with
            ``model``), a negative value or a priority outside 0 to :data:`LOWEST_PRIORITY`.
        redis.RedisError: when Redis fails.
    """
    allowed = MODEL_LIMIT_FIELDS if model else _LIMIT_FIELDS
    unknown = set(limits) - set(allowed)
    if unknown:
        raise ValueError(f"unknown {'per-model ' if model else ''}key limits: {sorted(unknown)}"
                         + (f" (per model: {', '.join(MODEL_LIMIT_FIELDS)})" if model else ""))
    _check_values(limits)
    record = get_key(client, key_id)
    if record is None:
        return None
    digest = client.get(_ID_KEY.format(key_id))
    digest = digest.decode() if isinstance(digest, bytes) else digest
    mapping = {} if model else {k: str(int(v)) for k, v in limits.items()}
    if model and limits:
        current = asdict(record.limits_for_model(model) or ModelLimits())
        current.update({k: int(v) for k, v in limits.items()})
        pairs = {name: lim for name, lim in record.model_limits}
        pairs[model] = ModelLimits(**current)
        kept = tuple(sorted((n, lim) for n, lim in pairs.items() if any(asdict(lim).values())))
        mapping["model_limits"] = _encode_model_limits(kept)
    if models is not None:
        mapping["models"] = _encode_models(tuple(models))
    if mapping:
        client.hset(_HASH_KEY.format(digest), mapping=mapping)
    return get_key(client, key_id)


def bearer_token(header: str | None) -> str:
    """The key inside an ``Authorization: Bearer <key>`` value.

    Raises:
        AuthenticationError: when the header is missing or not a Bearer token.
    """
    if not header:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'",
                                  code="missing_api_key")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("malformed Authorization header: expected 'Bearer <key>'",
                                  code="invalid_api_key")
    return token.strip()


def _check(raw: dict, presented: str) -> KeyRecord:
    if not raw:
        raise AuthenticationError("invalid API key", code="invalid_api_key")
    record, stored_hash = _decode(raw)
    if not hmac.compare_digest(stored_hash.encode(), hash_key(presented).encode()):
        raise AuthenticationError("invalid API key", code="invalid_api_key")
    if record.revoked:
        raise AuthenticationError("this API key has been revoked", code="revoked_api_key")
    return record


def authenticate(client: redis.Redis, presented: str) -> KeyRecord:
    """The record of a presented plaintext key (sync client).

    Raises:
        AuthenticationError: unknown or revoked key.
        UnavailableError: Redis unreachable.
    """
    try:
        raw = client.hgetall(_HASH_KEY.format(hash_key(presented)))
    except redis.RedisError as exc:
        raise redis_unavailable("the key store", exc) from exc
    return _check(raw, presented)


async def authenticate_async(client: redis.asyncio.Redis, presented: str) -> KeyRecord:
    """The record of a presented plaintext key (asyncio client, the gateway's hot path).

    Raises:
        AuthenticationError: unknown or revoked key.
        UnavailableError: Redis unreachable.
    """
    try:
        raw = await client.hgetall(_HASH_KEY.format(hash_key(presented)))
    except (redis.RedisError, OSError) as exc:
        raise redis_unavailable("the key store", exc) from exc
    return _check(raw, presented)
