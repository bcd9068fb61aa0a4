"""API keys against a private Redis."""

import asyncio

import pytest
import redis
import redis.asyncio

from gateway import keys
from gateway.errors import AuthenticationError, UnavailableError


@pytest.fixture()
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_create_authenticate_list_revoke(client):
    key_id, plaintext = keys.create_key(client, "acme", "ci", priority=0, max_max_tokens=64)
    assert plaintext.startswith("sk-inflight-") and key_id.startswith("key_")
    assert client.keys(f"*{plaintext}*") == []  # never stored in clear
    record = keys.authenticate(client, plaintext)
    assert (record.tenant, record.priority, record.max_max_tokens) == ("acme", 0, 64)
    assert [r.key_id for r in keys.list_keys(client)] == [key_id]
    assert keys.revoke_key(client, key_id) and not keys.revoke_key(client, "key_nope")
    with pytest.raises(AuthenticationError, match="revoked"):
        keys.authenticate(client, plaintext)
    assert keys.list_keys(client)[0].revoked


def test_unknown_key_and_bad_limits(client):
    with pytest.raises(AuthenticationError):
        keys.authenticate(client, "sk-inflight-nope")
    with pytest.raises(ValueError):
        keys.create_key(client, "acme", bogus=1)


def test_bearer_parsing():
    assert keys.bearer_token("Bearer abc") == "abc"
    for bad in (None, "", "Basic abc", "Bearer "):
        with pytest.raises(AuthenticationError):
            keys.bearer_token(bad)


def test_async_authenticate_and_redis_down(client, redis_url):
    _, plaintext = keys.create_key(client, "acme")

    async def go():
        good = redis.asyncio.Redis.from_url(redis_url)
        assert (await keys.authenticate_async(good, plaintext)).tenant == "acme"
        await good.aclose()
        dead = redis.asyncio.Redis(port=1, socket_connect_timeout=0.2)
        with pytest.raises(UnavailableError):
            await keys.authenticate_async(dead, plaintext)
        await dead.aclose()

    asyncio.run(go())


def test_priority_outside_served_classes_refused(client):
    """Only classes 0..2 are read by workers: a key with another would queue forever."""
    for bad in (7, 3, -1):
        with pytest.raises(ValueError, match="priority must be 0 to 2"):
            keys.create_key(client, "acme", priority=bad)
    key_id, _ = keys.create_key(client, "acme", priority=2)
    with pytest.raises(ValueError, match="priority must be 0 to 2"):
        keys.set_limits(client, key_id, priority=-1)
    assert keys.get_key(client, key_id).priority == 2


def test_stored_out_of_range_priority_is_clamped(caplog):
    """A record written before the check (or by hand) is queued in a class workers read."""
    from gateway.admission.key_limits import priority_for

    with caplog.at_level("WARNING"):
        assert priority_for(keys.KeyRecord(key_id="key_x", tenant="t", priority=7), None) == 2
        assert priority_for(keys.KeyRecord(key_id="key_x", tenant="t", priority=-1), 1) == 1
        assert priority_for(keys.KeyRecord(key_id="key_x", tenant="t", priority=-1), None) == 0
    assert "key_x has priority 7 outside 0..2" in caplog.text
    # logged once per key and stored value, not on every request
    assert caplog.text.count("key_x has priority 7") == 1 and caplog.text.count("key_x has priority -1") == 1
