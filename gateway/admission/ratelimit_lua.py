"""The two Lua scripts of per-key admission (run atomically by Redis, one round trip each),
kept beside this module as ``admit.lua`` and ``release.lua`` (package data) and read once
at import.

Algorithm: the sliding-window *log* (Redis "rate limiting" pattern with sorted sets,
see the Redis docs on ZADD/ZREMRANGEBYSCORE and "sliding window rate limiter"):
every admitted request is a member of a sorted set scored by its admission time
(microseconds from ``redis.call('TIME')``, the Redis server's clock, so several
gateway processes share one clock). A request is admitted when, after dropping
members older than the window, ``count < requests_per_min`` and
``reserved_tokens + cost <= tokens_per_min``. Reserved tokens per member live in a
hash and their sum in a counter kept exact by the same scripts (no drift: every
change happens inside a script). Nothing is written unless every check passes.

KEYS: one or two *window sets* of five keys each, then the queue streams. Set 1 is the API
key's; set 2, when the key has limits for the request's model (``KeyRecord.model_limits``),
the key's for that model. Each set: 1 requests zset, 2 token zset, 3 token hash (member ->
tokens), 4 token sum, 5 in-flight zset (member -> expiry, microseconds); all hash-tagged
``{key_id}`` (the queue stream is global, so this needs one Redis, not Cluster). After the
sets: the priority's request streams (the shared one and the workers' own ones; their XLENs
add up to the queue depth).

ADMIT ARGV: member, cost (tokens), inflight_ttl_us, queue_limit, window_us, number of sets,
then per set: rpm, tpm, max_inflight. A limit of 0 is "none". Every set is checked in order
(requests/min, tokens/min, in-flight) before the queue depth; the request is reserved in
every set or in none. Returns ``{admitted(0/1), reason, retry_after_us, count, set (1-based:
which set refused; 0 = none or the queue), limit_requests, remaining_requests,
reset_requests_us, limit_tokens, remaining_tokens, reset_tokens_us}`` with reason one of
``ok key_rate key_tokens_never key_tokens in_flight queue_full``. The last six are OpenAI's
``x-ratelimit-*`` values from the same atomic view as the decision (so exact across gateway
replicas), per unit from the set with a limit and the least left: what is left in the window
after this request (without it when it was refused) and the microseconds until the window's
newest entry leaves it, when the window is back at its full limit ("resets to its initial
state", as OpenAI defines the reset headers); 0 for no limit.

RELEASE KEYS: the window sets the request was admitted in (five keys each). ARGV: member,
used_tokens, rollback(0/1). In every set, lowers the member's reservation to ``used_tokens``
(never raises it: calling twice is harmless), removes it from the in-flight set, and with
rollback removes it from both windows (nothing was queued). Returns the tokens refunded.
"""

from __future__ import annotations

from importlib import resources


def _script(name: str) -> str:
    """The source of the Lua script ``name`` in this package.

    Raises:
        FileNotFoundError: the file was not installed (``*.lua`` missing from package data).
    """
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


ADMIT = _script("admit.lua")
RELEASE = _script("release.lua")
