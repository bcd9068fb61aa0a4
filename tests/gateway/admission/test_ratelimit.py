"""The admission Lua script against a real Redis: exact windows across clients, refunds,
Retry-After from the window, in-flight cap, queue depth."""

import asyncio
import time

import pytest
import redis.asyncio

from gateway.errors import InvalidRequestError, RateLimitError
from gateway.keys import KeyRecord
from gateway.admission.ratelimit import AdmissionPolicy, Limiter

STREAM = "inflight:requests:1"


def run(coro):
    return asyncio.run(coro)


async def _race(redis_url, key, n_clients, attempts, cost=1, policy=AdmissionPolicy()):
    """``attempts`` admissions spread over ``n_clients`` separate connections, concurrently."""
    clients = [redis.asyncio.Redis.from_url(redis_url) for _ in range(n_clients)]
    limiters = [Limiter(c, policy) for c in clients]

    async def one(i):
        try:
            return await limiters[i % n_clients].admit(key, cost, STREAM, 0)
        except RateLimitError as exc:
            return exc
    try:
        return await asyncio.gather(*(one(i) for i in range(attempts)))
    finally:
        for c in clients:
            await c.aclose()


def test_request_window_is_exact_across_clients(redis_url):
    key = KeyRecord("key_a", "t", requests_per_min=25)
    results = run(_race(redis_url, key, n_clients=4, attempts=80))
    admitted = [r for r in results if not isinstance(r, Exception)]
    rejected = [r for r in results if isinstance(r, RateLimitError)]
    assert len(admitted) == 25 and len(rejected) == 55
    assert {r.code for r in rejected} == {"key_rate"}
    # Retry-After: when the oldest admission leaves the 60 s window.
    assert all(55 < r.retry_after_s <= 60 for r in rejected)
    assert "25 requests per 60 s" in rejected[0].message


def test_token_window_is_exact_and_refund_reopens_it(redis_url):
    key = KeyRecord("key_b", "t", tokens_per_min=1000)
    results = run(_race(redis_url, key, n_clients=3, attempts=30, cost=100))
    admitted = [r for r in results if not isinstance(r, Exception)]
    assert len(admitted) == 10
    assert {r.code for r in results if isinstance(r, Exception)} == {"key_tokens"}

    async def refund_then_admit():
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = Limiter(client)
        refunded = await limiter.release(admitted[0], used_tokens=30)
        again = await limiter.release(admitted[0], used_tokens=90)  # never raises a reservation
        got = await limiter.admit(key, 70, STREAM, 0)  # exactly the 70 refunded
        with pytest.raises(RateLimitError):
            await limiter.admit(key, 1, STREAM, 0)
        await client.aclose()
        return refunded, again, got
    refunded, again, got = run(refund_then_admit())
    assert (refunded, again, got.cost_tokens) == (70, 0, 70)


def test_cost_above_tpm_is_a_400_not_a_retry(redis_url):
    key = KeyRecord("key_c", "t", tokens_per_min=50)

    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            await Limiter(client).admit(key, 51, STREAM, 0)
        finally:
            await client.aclose()
    with pytest.raises(InvalidRequestError) as info:
        run(go())
    assert info.value.param == "max_tokens" and info.value.code == "key_tokens"


def test_window_slides_and_retry_after_tracks_oldest(redis_url):
    """Retry-After is when the oldest admission leaves the 1 s window. Each admission's
    and rejection's time is bracketed by the client's clock around its call, so the
    expected Retry-After is an interval from measured times, not a figure that a late
    sleep on a loaded machine breaks; the second admission comes 0.7 s after the first,
    so it is still in the window when the second rejection is checked, with 0.6 s of
    slack."""
    key = KeyRecord("key_d", "t", requests_per_min=2)
    policy = AdmissionPolicy(window_s=1.0)
    clock = time.monotonic

    async def timed(call):
        before = clock()
        try:
            result = await call
        except RateLimitError as exc:
            result = exc
        return result, before, clock()

    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = Limiter(client, policy)
        try:
            a1 = await timed(limiter.admit(key, 1, STREAM, 0))
            await asyncio.sleep(0.7)
            a2 = await timed(limiter.admit(key, 1, STREAM, 0))
            r1 = await timed(limiter.admit(key, 1, STREAM, 0))
            assert isinstance(r1[0], RateLimitError), r1
            await asyncio.sleep(r1[0].retry_after_s + 0.05)
            a3 = await timed(limiter.admit(key, 1, STREAM, 0))  # the oldest left the window
            r2 = await timed(limiter.admit(key, 1, STREAM, 0))
            return a1, a2, r1, a3, r2
        finally:
            await client.aclose()

    a1, a2, r1, a3, r2 = run(go())
    assert not any(isinstance(r[0], Exception) for r in (a1, a2, a3)), (a1, a2, a3)
    assert isinstance(r2[0], RateLimitError), f"not refused {r2[1] - a2[2]:.2f} s after the second admission"
    assert r1[0].code == r2[0].code == "key_rate"

    def window_left(oldest, rejected, slack=0.005):
        """The interval the Retry-After must fall in: 1 s minus the time from the oldest
        admission (between its call and return) to the rejection (likewise)."""
        return 1.0 - (rejected[2] - oldest[1]) - slack, 1.0 - (rejected[1] - oldest[2]) + slack

    low, high = window_left(a1, r1)  # the first admission is the oldest
    assert low <= r1[0].retry_after_s <= high, (r1[0].retry_after_s, low, high)
    low, high = window_left(a2, r2)  # now the second one is
    assert low <= r2[0].retry_after_s <= high, (r2[0].retry_after_s, low, high)


def test_inflight_cap_and_release(redis_url):
    key = KeyRecord("key_e", "t", max_inflight=2)

    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = Limiter(client)
        a = await limiter.admit(key, 10, STREAM, 0)
        await limiter.admit(key, 10, STREAM, 0)
        with pytest.raises(RateLimitError) as info:
            await limiter.admit(key, 10, STREAM, 0)
        await limiter.release(a, 0)
        await limiter.release(a, 0)  # idempotent: frees one slot, not two
        await limiter.admit(key, 10, STREAM, 0)
        with pytest.raises(RateLimitError):
            await limiter.admit(key, 10, STREAM, 0)
        await client.aclose()
        return info.value
    err = run(go())
    assert err.code == "in_flight" and "2 queued or running" in err.message


def test_inflight_slot_expires_when_never_released(redis_url):
    key = KeyRecord("key_f", "t", max_inflight=1)

    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = Limiter(client, AdmissionPolicy(inflight_ttl_s=0.3))
        await limiter.admit(key, 1, STREAM, 0)
        with pytest.raises(RateLimitError):
            await limiter.admit(key, 1, STREAM, 0)
        await asyncio.sleep(0.35)
        await limiter.admit(key, 1, STREAM, 0)
        await client.aclose()
    run(go())


def test_queue_depth_and_check_order(redis_url):
    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = Limiter(client)
        for _ in range(3):
            await client.xadd(STREAM, {"req": b"x"})
        with pytest.raises(RateLimitError) as full:
            await limiter.admit(KeyRecord("key_g", "t"), 1, STREAM, 3)
        rate_key = KeyRecord("key_h", "t", requests_per_min=1)
        await limiter.admit(rate_key, 1, STREAM, 0)
        with pytest.raises(RateLimitError) as first:  # the window is checked before the queue
            await limiter.admit(rate_key, 1, STREAM, 3)
        await limiter.admit(KeyRecord("key_g", "t"), 1, "inflight:requests:0", 3)  # other class
        await client.aclose()
        return full.value, first.value
    full, first = run(go())
    assert full.code == "queue_full" and full.retry_after_s == 1.0
    assert first.code == "key_rate"


def test_rollback_removes_from_windows(redis_url):
    """A rolled-back admission (nothing was queued) leaves no trace: not in the request
    window, not in the token window, not in flight; all its tokens come back, and the
    key's one request a minute is free again."""
    import redis as sync_redis

    from gateway.admission.ratelimit import window_usage

    key = KeyRecord("key_i", "t", requests_per_min=1, tokens_per_min=10, max_inflight=1)
    usage = []

    async def go():
        client = redis.asyncio.Redis.from_url(redis_url)
        sync = sync_redis.Redis.from_url(redis_url)
        limiter = Limiter(client)
        try:
            r = await limiter.admit(key, 10, STREAM, 0)
            usage.append(window_usage(sync, key.key_id))
            refunded = await limiter.release(r, 0, rollback=True)
            usage.append(window_usage(sync, key.key_id))
            again = await limiter.admit(key, 10, STREAM, 0)
            usage.append(window_usage(sync, key.key_id))
            with pytest.raises(RateLimitError) as full:  # the window holds the new one only
                await limiter.admit(key, 1, STREAM, 0)
            return refunded, again, full.value
        finally:
            await client.aclose()
            sync.close()

    refunded, again, full = run(go())
    assert refunded == 10 and again.member
    assert usage == [{"requests": 1, "tokens": 10, "in_flight": 1},
                     {"requests": 0, "tokens": 0, "in_flight": 0},
                     {"requests": 1, "tokens": 10, "in_flight": 1}]
    assert full.code == "key_rate"
