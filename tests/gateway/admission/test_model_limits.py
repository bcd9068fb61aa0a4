"""A key's limits per model (issue 44 item 4) against a real Redis: the model's windows and
in-flight cap beside the key's, both reserved or neither, exact across clients, refunded and
released with the key's; the key's model list; `inflight keys set --model` round trip."""

import asyncio

import pytest
import redis
import redis.asyncio

from gateway import keys
from gateway.admission.ratelimit import Limiter, window_usage
from gateway.errors import RateLimitError
from gateway.keys import KeyRecord, ModelLimits

STREAM = "inflight:requests:1"


def _key(**kw) -> KeyRecord:
    return KeyRecord("key_m", "t", model_limits=(("big", ModelLimits(**kw)),))


def test_a_models_request_window_refuses_that_model_only(redis_url):
    key = _key(requests_per_min=2)

    async def go():
        limiter = Limiter(redis.asyncio.Redis.from_url(redis_url))
        for _ in range(2):
            await limiter.admit(key, 1, STREAM, 0, model="big")
        with pytest.raises(RateLimitError) as info:
            await limiter.admit(key, 1, STREAM, 0, model="big")
        assert info.value.code == "key_rate" and "model 'big'" in str(info.value)
        assert info.value.headers["x-ratelimit-limit-requests"] == "2"
        assert info.value.headers["x-ratelimit-remaining-requests"] == "0"
        for _ in range(5):  # another model, and the key itself, are not limited
            await limiter.admit(key, 1, STREAM, 0, model="small")

    asyncio.run(go())


def test_key_and_model_windows_reserve_together_or_not_at_all(redis_url):
    """The key's own tokens window refuses: nothing is left in the model's windows either."""
    key = KeyRecord("key_b", "t", tokens_per_min=100,
                    model_limits=(("big", ModelLimits(requests_per_min=10, tokens_per_min=1000)),))

    async def go():
        limiter = Limiter(redis.asyncio.Redis.from_url(redis_url))
        await limiter.admit(key, 80, STREAM, 0, model="big")
        with pytest.raises(RateLimitError) as info:
            await limiter.admit(key, 30, STREAM, 0, model="big")
        assert "model" not in str(info.value)  # the key's own window said no
        sync = redis.Redis.from_url(redis_url)
        assert sync.zcard("inflight:rl:{key_b}:m:big:req") == 1
        assert int(sync.get("inflight:rl:{key_b}:m:big:toksum")) == 80

    asyncio.run(go())


def test_model_windows_are_exact_across_concurrent_clients(redis_url):
    key = _key(requests_per_min=7)

    async def go():
        limiters = [Limiter(redis.asyncio.Redis.from_url(redis_url)) for _ in range(4)]

        async def one(i):
            try:
                return await limiters[i % 4].admit(key, 1, STREAM, 0, model="big")
            except RateLimitError as exc:
                return exc

        results = await asyncio.gather(*(one(i) for i in range(20)))
        assert sum(not isinstance(r, Exception) for r in results) == 7

    asyncio.run(go())


def test_model_in_flight_cap_and_token_refund_follow_release(redis_url):
    key = _key(max_inflight=1, tokens_per_min=100)

    async def go():
        limiter = Limiter(redis.asyncio.Redis.from_url(redis_url))
        first = await limiter.admit(key, 90, STREAM, 0, model="big")
        with pytest.raises(RateLimitError) as info:
            await limiter.admit(key, 5, STREAM, 0, model="big")
        assert info.value.code == "in_flight"
        assert await limiter.release(first, used_tokens=20) == 70  # refunded in both sets
        await limiter.admit(key, 80, STREAM, 0, model="big")  # 20 + 80 fits the model's 100
        sync = redis.Redis.from_url(redis_url)
        assert int(sync.get("inflight:rl:{key_m}:m:big:toksum")) == 100

    asyncio.run(go())


def test_a_rolled_back_reservation_leaves_no_model_window_entry(redis_url):
    key = _key(requests_per_min=1)

    async def go():
        limiter = Limiter(redis.asyncio.Redis.from_url(redis_url))
        first = await limiter.admit(key, 1, STREAM, 0, model="big")
        await limiter.release(first, 0, rollback=True)  # nothing was queued
        await limiter.admit(key, 1, STREAM, 0, model="big")

    asyncio.run(go())


def test_model_list_and_per_model_limits_round_trip_through_the_key_store(redis_url):
    client = redis.Redis.from_url(redis_url)
    key_id, plaintext = keys.create_key(client, "acme", models=("SmolLM2-135M-Instruct", "tiny"))
    record = keys.authenticate(client, plaintext)
    assert record.may_use("tiny") and not record.may_use("other")
    assert KeyRecord("k", "t").may_use("anything")  # no list: every model
    record = keys.set_limits(client, key_id, model="tiny", requests_per_min=3)
    record = keys.set_limits(client, key_id, model="tiny", max_inflight=2)  # merged with the rpm
    assert record.limits_for_model("tiny") == ModelLimits(requests_per_min=3, max_inflight=2)
    assert record.limits_for_model("SmolLM2-135M-Instruct") is None
    record = keys.set_limits(client, key_id, model="tiny", requests_per_min=0, max_inflight=0)
    assert record.model_limits == ()  # all 0: removed
    record = keys.set_limits(client, key_id, models=())
    assert record.models == () and record.may_use("other")
    with pytest.raises(ValueError, match="per-model"):
        keys.set_limits(client, key_id, model="tiny", max_max_tokens=5)


def test_inflight_keys_cli_sets_a_models_limits(redis_url, capsys):
    from inflight.cli import main

    client = redis.Redis.from_url(redis_url)
    key_id, _ = keys.create_key(client, "acme")
    assert main(["keys", "set-limits", key_id, "--model", "tiny", "--rpm", "4", "--redis-url", redis_url]) == 0
    assert main(["keys", "set", key_id, "--models", "tiny,SmolLM2-135M-Instruct", "--redis-url", redis_url]) == 0
    record = keys.get_key(client, key_id)
    assert record.limits_for_model("tiny") == ModelLimits(requests_per_min=4)
    assert record.models == ("tiny", "SmolLM2-135M-Instruct")
    assert window_usage(client, key_id)["requests"] == 0
    assert main(["keys", "create", "--model", "tiny", "--redis-url", redis_url]) == 2
