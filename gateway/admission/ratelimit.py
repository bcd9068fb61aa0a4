"""Per-key admission in Redis: sliding windows, in-flight cap, queue backpressure.

One Lua script (``gateway.admission.ratelimit_lua.ADMIT``) checks, in the design's order,
requests/min → tokens/min → in-flight → queue depth, and reserves the request in
every structure only when all pass; so N gateway processes sharing one Redis
admit exactly what one would. :meth:`Limiter.release` refunds the unused tokens
(real usage from the worker's ``Finished.usage``) and frees the in-flight slot;
it is idempotent. Every in-flight entry also carries an expiry (the request
timeout plus a margin) so a gateway that dies without releasing cannot hold a
key's slots for longer than that (the TTL safety net).
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

import redis
import redis.asyncio

from gateway.admission import ratelimit_lua
from gateway.errors import InflightError, InvalidRequestError, RateLimitError, redis_unavailable
from gateway.keys import KeyRecord, ModelLimits

WINDOW_S = 60.0  # requests_per_min / tokens_per_min are per 60 s
_PREFIX = "inflight:rl:{{{}}}:"  # hash tag: one key's structures share a slot


@dataclass(frozen=True)
class AdmissionPolicy:
    """Server-side knobs of admission (times in seconds).

    Attributes:
        window_s: sliding window length (60 s for per-minute limits; shorter in tests).
        inflight_ttl_s: lifetime of an in-flight slot nobody released (request timeout + margin).
        busy_retry_after_s: ``Retry-After`` hint for in-flight and queue-full rejections,
            whose end cannot be computed from a window.
    """

    window_s: float = WINDOW_S
    inflight_ttl_s: float = 630.0
    busy_retry_after_s: float = 1.0


def openai_duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes its ``x-ratelimit-reset-*`` headers (Go's duration
    format, to the millisecond): ``"0s"``, ``"20ms"``, ``"1.5s"``, ``"6m0s"``, ``"1h0m0s"``."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


@dataclass(frozen=True)
class RateLimitState:
    """A key's windows as the admission script saw them, for OpenAI's rate-limit headers.

    Attributes:
        limit_requests, limit_tokens: the key's requests/min and tokens/min (0 = none).
        remaining_requests, remaining_tokens: left in the window after this request
            (without it when it was refused; tokens as reserved: prompt + max_tokens).
        reset_requests_s, reset_tokens_s: seconds until the window is back at its full
            limit (its newest entry leaves it).
    """

    limit_requests: int
    remaining_requests: int
    reset_requests_s: float
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float

    def headers(self) -> dict[str, str]:
        """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the limits the key
        has (none for a limit of 0), as OpenAI sends them."""
        out: dict[str, str] = {}
        for unit, limit, remaining, reset in (
                ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
                ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s)):
            if limit > 0:
                out[f"x-ratelimit-limit-{unit}"] = str(limit)
                out[f"x-ratelimit-remaining-{unit}"] = str(remaining)
                out[f"x-ratelimit-reset-{unit}"] = openai_duration(reset)
        return out


@dataclass(frozen=True)
class Reservation:
    """An admitted request's reservation: key, member id and reserved tokens, the key's
    windows right after it was admitted (``rate_limit``), and the model whose per-key
    windows it is also in ("" = none: the key has no limits for that model)."""

    key_id: str
    member: str
    cost_tokens: int
    rate_limit: RateLimitState | None = None
    model: str = ""


def _window_keys(key_id: str, model: str = "") -> list[str]:
    """The five structures of one window set: the key's (``model`` "") or the key's for one
    model; all hash-tagged by the key id."""
    base = _PREFIX.format(key_id) + (f"m:{model}:" if model else "")
    return [base + "req", base + "tok", base + "tokamt", base + "toksum", base + "inflight"]


def _keys(key_id: str, streams: str | list[str], model: str = "") -> list[str]:
    streams = [streams] if isinstance(streams, str) else list(streams)
    model_set = _window_keys(key_id, model) if model else []
    return [*_window_keys(key_id), *model_set, *streams]


def _rejection(reason: str, retry_us: int, limits: ModelLimits, cost: int, policy: AdmissionPolicy,
               queue_limit: int, model: str = "") -> InflightError:
    """The error for a rejection ``reason`` returned by the script, against ``limits`` (the
    key's, or the key's for ``model``)."""
    retry_s = max(0.0, retry_us / 1e6)
    busy = policy.busy_retry_after_s
    window = f"{policy.window_s:g} s"
    whose = f"this key allows for model '{model}'" if model else "this key allows"
    if reason == "key_tokens_never":
        return InvalidRequestError(
            f"this request needs {cost} tokens (prompt + max_tokens), more than the "
            f"tokens_per_min limit of {limits.tokens_per_min} {whose[5:]}; lower max_tokens",
            param="max_tokens", code="key_tokens")
    messages = {
        "key_rate": f"rate limit: {whose} {limits.requests_per_min} requests per {window}",
        "key_tokens": f"rate limit: {whose} {limits.tokens_per_min} tokens (prompt + "
                      f"max_tokens) per {window}; this request needs {cost}",
        "in_flight": f"too many requests in flight: {whose} {limits.max_inflight} queued "
                     f"or running at once",
        "queue_full": f"the server is busy: the request queue is full ({queue_limit} waiting)",
    }
    retry = retry_s if reason in ("key_rate", "key_tokens") else busy
    return RateLimitError(f"{messages[reason]}; retry after {retry:.1f} s", retry_after_s=retry,
                          code=reason)


class Limiter:
    """Runs the admission and release scripts on ``client`` (asyncio Redis)."""

    def __init__(self, client: redis.asyncio.Redis, policy: AdmissionPolicy = AdmissionPolicy()):
        self.policy = policy
        self._admit = client.register_script(ratelimit_lua.ADMIT)
        self._release = client.register_script(ratelimit_lua.RELEASE)

    async def admit(self, key: KeyRecord, cost_tokens: int, stream: str | list[str],
                    queue_limit: int, model: str = "") -> Reservation:
        """Reserve one request of ``cost_tokens`` tokens for ``key`` (the entries of
        ``stream``, one stream or several whose lengths add up: the shared stream of a
        priority and the workers' own ones, must stay below ``queue_limit``; 0 = no limit).
        When the key has limits for ``model`` (``KeyRecord.model_limits``), the request must
        also fit the key's windows for that model, and is reserved in both or in neither.

        Raises (each admission error carries the key's rate-limit headers in ``headers``):
            RateLimitError: requests/min, tokens/min, in-flight cap or queue depth
                (``code`` = key_rate, key_tokens, in_flight, queue_full), the key's or the
                key's for ``model`` (the message says which).
            InvalidRequestError: the cost alone exceeds tokens/min (can never pass).
            UnavailableError: Redis unreachable.
        """
        member = uuid.uuid4().hex
        per_model = key.limits_for_model(model) if model else None
        sets = [ModelLimits(key.requests_per_min, key.tokens_per_min, key.max_inflight)]
        sets += [per_model] if per_model is not None else []
        args = [member, cost_tokens, int(self.policy.inflight_ttl_s * 1e6), queue_limit,
                int(self.policy.window_s * 1e6), len(sets)]
        for limits in sets:
            args += [limits.requests_per_min, limits.tokens_per_min, limits.max_inflight]
        windowed = model if per_model is not None else ""
        try:
            ok, reason, retry_us, _, at, *window = await self._admit(
                keys=_keys(key.key_id, stream, windowed), args=args)
        except (redis.RedisError, OSError) as exc:
            raise redis_unavailable("the rate limiter", exc) from exc
        lim_req, rem_req, reset_req_us, lim_tok, rem_tok, reset_tok_us = (int(v) for v in window)
        state = RateLimitState(lim_req, rem_req, reset_req_us / 1e6, lim_tok, rem_tok, reset_tok_us / 1e6)
        if not ok:
            reason = reason.decode() if isinstance(reason, bytes) else reason
            limits = sets[int(at) - 1] if int(at) >= 1 else sets[0]
            err = _rejection(reason, int(retry_us), limits, cost_tokens, self.policy, queue_limit,
                             windowed if int(at) == 2 else "")
            err.headers.update(state.headers())
            raise err
        return Reservation(key.key_id, member, cost_tokens, state, windowed)

    async def count_request(self, key: KeyRecord) -> RateLimitState:
        """Count one request in ``key``'s requests/min window only (the same script, with
        no tokens, no in-flight slot and no queue): for what answers at once and is never
        queued (``/tokenize``, ``/v1/messages/count_tokens``). Nothing is left to release.

        Raises (the error carries the key's rate-limit headers in ``headers``):
            RateLimitError: requests/min (``code`` key_rate).
            UnavailableError: Redis unreachable.
        """
        quiet = dataclasses.replace(key, tokens_per_min=0, max_inflight=0)
        reservation = await self.admit(quiet, 0, [], 0)
        return reservation.rate_limit

    async def release(self, reservation: Reservation, used_tokens: int,
                      rollback: bool = False) -> int:
        """Free the in-flight slot and refund ``cost - used_tokens`` tokens; ``rollback``
        (nothing was queued) also removes the request from both windows. Idempotent.
        Returns the tokens refunded.

        Raises:
            UnavailableError: Redis unreachable (the slot then expires by its TTL).
        """
        args = [reservation.member, max(0, int(used_tokens)), int(rollback)]
        try:
            return int(await self._release(keys=_keys(reservation.key_id, [], reservation.model), args=args))
        except (redis.RedisError, OSError) as exc:
            raise redis_unavailable("the rate limiter", exc) from exc


def window_usage(client: redis.Redis, key_id: str, window_s: float = WINDOW_S) -> dict[str, int]:
    """A key's current usage (sync client, for ``inflight keys show``): requests and
    reserved tokens admitted within the last ``window_s`` seconds of Redis time, and
    requests in flight.

    Raises:
        redis.RedisError: when Redis fails.
    """
    k = _keys(key_id, [])
    sec, usec = client.time()
    now_us = sec * 1_000_000 + usec
    cutoff = f"({now_us - int(window_s * 1e6)}"
    requests = client.zcount(k[0], cutoff, "+inf")
    members = client.zrangebyscore(k[1], cutoff, "+inf")
    tokens = sum(int(v or 0) for v in client.hmget(k[2], members)) if members else 0
    in_flight = client.zcount(k[4], f"({now_us}", "+inf")
    return {"requests": int(requests), "tokens": tokens, "in_flight": int(in_flight)}
