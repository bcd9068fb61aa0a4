"""``Admission.admit`` against a real Redis: the design's order, ``before_reserve`` between
the checks and the reservation, nothing reserved on any failure, rejections counted."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
import redis.asyncio

from gateway.admission.params import RequestParams
from gateway.admission.pipeline import Admission
from gateway.admission.ratelimit import window_usage
from gateway.errors import InvalidRequestError, NotFoundError, RateLimitError, UnavailableError, rejection_reason
from gateway.keys import KeyRecord
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from tests.gateway.fake_tokenizer import CharTokenizer

OK = RequestParams(prompt="hello", max_tokens=4)


def _rejections(metrics: GatewayMetrics) -> dict[str, float]:
    return {s.labels["reason"]: s.value for m in metrics.rejections.collect() for s in m.samples
            if s.name.endswith("_total")}


def _rejections_by_model(metrics: GatewayMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["reason"], s.labels["model_name"]): s.value for m in metrics.rejections.collect()
            for s in m.samples if s.name.endswith("_total")}


def _admit(redis_url: str, key: KeyRecord, params: RequestParams, before_reserve=None,
           rid: str | None = None, **settings):
    """Run ``admit`` once; returns (result or exception, before_reserve calls, metrics)."""
    metrics, calls = GatewayMetrics(), []

    def record(decision):
        calls.append(decision)
        return before_reserve(decision) if before_reserve else "prepared"

    async def scenario():
        client = redis.asyncio.Redis.from_url(redis_url)
        admission = Admission(GatewaySettings(**{"require_worker": False, **settings}), client,
                              CharTokenizer(), metrics)
        try:
            return await admission.admit(key, params, record, request_id=rid)
        except Exception as exc:  # the test looks at it
            return exc
        finally:
            await client.aclose()

    return asyncio.run(scenario()), calls, metrics


def _usage(redis_url: str, key_id: str) -> dict[str, int]:
    client = redis.Redis.from_url(redis_url)
    try:
        return window_usage(client, key_id)
    finally:
        client.close()


def test_admitted_request_is_reserved_after_before_reserve(redis_url):
    key = KeyRecord(key_id="k1", tenant="t", priority=0, requests_per_min=5, tokens_per_min=100,
                    max_inflight=2)
    admitted, calls, _ = _admit(redis_url, key, RequestParams(prompt="hello", max_tokens=4, priority=2))
    assert admitted.prepared == "prepared" and calls == [admitted.decision]
    assert (admitted.decision.priority, admitted.decision.cost_tokens) == (2, 5 + 4)
    assert admitted.reservation.cost_tokens == 9
    assert _usage(redis_url, "k1") == {"requests": 1, "tokens": 9, "in_flight": 1}


def test_before_reserve_failure_reserves_nothing_and_is_not_a_rejection(redis_url):
    key = KeyRecord(key_id="k2", tenant="t", requests_per_min=5, tokens_per_min=100, max_inflight=1)

    def refuse(decision):
        raise InvalidRequestError("already in use", param="request_id")

    result, calls, metrics = _admit(redis_url, key, OK, refuse)
    assert isinstance(result, InvalidRequestError) and len(calls) == 1
    assert _usage(redis_url, "k2") == {"requests": 0, "tokens": 0, "in_flight": 0}
    assert _rejections(metrics) == {}


def test_validation_comes_before_the_request_id_and_the_windows(redis_url):
    key = KeyRecord(key_id="k3", tenant="t", requests_per_min=1)
    assert not isinstance(_admit(redis_url, key, OK)[0], Exception)  # uses the only slot
    result, calls, metrics = _admit(redis_url, key, RequestParams(prompt="hello", temperature=-1),
                                    rid="bad\nid")
    assert isinstance(result, InvalidRequestError) and result.param == "temperature" and not calls
    assert _rejections(metrics) == {"invalid_request": 1.0}
    result, calls, _ = _admit(redis_url, key, OK, rid="bad\nid")
    assert isinstance(result, InvalidRequestError) and result.param == "request_id" and not calls
    result, calls, metrics = _admit(redis_url, key, OK)
    assert isinstance(result, RateLimitError) and result.code == "key_rate" and len(calls) == 1
    assert _rejections(metrics) == {"key_rate": 1.0}
    assert _usage(redis_url, "k3")["requests"] == 1


def test_no_worker_is_refused_before_before_reserve(redis_url):
    redis_url = redis_url.rsplit("/", 1)[0] + "/4"  # a db the session's fake worker does not heartbeat into
    redis.Redis.from_url(redis_url).flushdb()
    result, calls, metrics = _admit(redis_url, KeyRecord(key_id="k4", tenant="t"), OK,
                                    require_worker=True)
    assert isinstance(result, UnavailableError) and result.code == "no_worker" and not calls
    assert _rejections(metrics) == {"no_worker": 1.0}
    client = redis.Redis.from_url(redis_url)
    client.set("inflight:workers:w1", json.dumps({"model": GatewaySettings().served_model_name}), ex=10)
    client.close()
    assert not isinstance(_admit(redis_url, KeyRecord(key_id="k4", tenant="t"), OK,
                                 require_worker=True)[0], Exception)


def test_rejections_carry_the_served_model_never_the_name_sent(redis_url):
    """``inflight_gateway_rejections_total`` has ``model_name``: the served model's id once the
    request's model was resolved (a refused parameter, a key's window, no worker), "" for an
    unknown model (the client's string would let it grow the label set)."""
    served = GatewaySettings().served_model_name
    key = KeyRecord(key_id="k5", tenant="t", requests_per_min=1)
    result, _, metrics = _admit(redis_url, key, RequestParams(prompt="hello", temperature=-1))
    assert isinstance(result, InvalidRequestError)
    assert _rejections_by_model(metrics) == {("invalid_request", served): 1.0}
    result, _, metrics = _admit(redis_url, key, RequestParams(prompt="hello", model="no-such-model-x1"))
    assert isinstance(result, NotFoundError)
    assert list(_rejections_by_model(metrics).items()) == [((rejection_reason(result), ""), 1.0)]
    assert not isinstance(_admit(redis_url, key, OK)[0], Exception)  # uses the only slot
    result, _, metrics = _admit(redis_url, key, OK)
    assert isinstance(result, RateLimitError)
    assert _rejections_by_model(metrics) == {("key_rate", served): 1.0}
    empty = redis_url.rsplit("/", 1)[0] + "/4"  # no worker heartbeats there
    redis.Redis.from_url(empty).flushdb()
    result, _, metrics = _admit(empty, KeyRecord(key_id="k6", tenant="t"), OK, require_worker=True)
    assert isinstance(result, UnavailableError)
    assert _rejections_by_model(metrics) == {("no_worker", served): 1.0}
