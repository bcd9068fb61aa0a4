"""The router's choice (gateway/routing/scoring.py): Dynamo's cost, SGLang's cache
threshold for the shared-stream fallback, ties and temperature."""

from __future__ import annotations

import random

import pytest

from gateway.routing.scoring import Choice, RouterConfig, WorkerView, choose, cost
from gateway.settings import GatewaySettings

KV = RouterConfig()


def test_the_worker_holding_the_prefix_wins_when_loads_are_equal():
    views = [WorkerView("cold", 0, 10, 0), WorkerView("warm", 60, 10, 0)]
    assert choose(views, 62, KV) == Choice("warm", 60)


def test_a_warm_worker_with_prefills_queued_loses_to_an_idle_cold_one_and_the_request_goes_shared():
    # warm: 2 blocks to prefill but 2 requests of 62 blocks waiting ahead; cold: 62 to prefill
    views = [WorkerView("cold", 0, 0, 0), WorkerView("warm", 60, 0, 2)]
    assert cost(views[1], 62, 2.0) > cost(views[0], 62, 2.0)
    assert choose(views, 62, KV) == Choice(None)


def test_a_warm_worker_decoding_one_request_wins_by_default_not_at_dynamos_weight_1():
    views = [WorkerView("cold", 0, 0, 0), WorkerView("warm", 60, 65, 0)]  # one running request, 65 blocks
    assert choose(views, 62, KV).worker_id == "warm"
    assert choose(views, 62, RouterConfig(kv_overlap_score_weight=1.0)) == Choice(None)


def test_below_the_cache_threshold_nobody_stands_out():
    views = [WorkerView("a", 2, 0, 0), WorkerView("b", 0, 0, 0)]  # 2 of 10 blocks: a shared template
    assert choose(views, 10, KV) == Choice(None)
    assert choose(views, 10, RouterConfig(cache_threshold=0.2)).worker_id == "a"


def test_routing_off_and_empty_fleets_go_shared():
    views = [WorkerView("warm", 60, 0, 0), WorkerView("cold", 0, 0, 0)]
    assert choose(views, 62, KV).worker_id == "warm"
    assert choose(views, 62, RouterConfig(mode="shared")) == Choice(None)
    assert choose([], 62, KV) == Choice(None)
    assert choose(views[:1], 62, KV) == Choice(None)  # a lone worker reads the shared stream anyway
    assert choose(views, 0, KV) == Choice(None)


def test_ties_are_shared_between_equal_workers():
    views = [WorkerView("a", 60, 0, 0), WorkerView("b", 60, 0, 0)]
    rng = random.Random(7)
    picks = {choose(views, 62, KV, rng).worker_id for _ in range(40)}
    assert picks == {"a", "b"}


def test_temperature_samples_the_costlier_worker_sometimes_and_zero_never():
    views = [WorkerView("a", 60, 0, 0), WorkerView("b", 50, 0, 0)]
    rng = random.Random(3)
    assert {choose(views, 62, KV, rng).worker_id for _ in range(50)} == {"a"}
    hot = RouterConfig(router_temperature=1.0)
    picks = [choose(views, 62, hot, rng).worker_id for _ in range(400)]
    assert 0.5 < picks.count("a") / len(picks) < 0.9  # exp(0) : exp(-1) = 0.73 : 0.27


@pytest.mark.parametrize("bad", [dict(mode="round-robin"), dict(cache_threshold=0.0),
                                 dict(kv_overlap_score_weight=-1.0), dict(router_temperature=-0.1)])
def test_bad_tunables_are_refused_when_the_settings_are_built(bad):
    fields = {"mode": "router_mode"}
    with pytest.raises(ValueError):
        GatewaySettings(**{fields.get(k, k): v for k, v in bad.items()})


def test_tunables_come_from_the_environment():
    settings = GatewaySettings.from_env({"INFLIGHT_GATEWAY_ROUTER_MODE": "shared",
                                         "INFLIGHT_GATEWAY_KV_OVERLAP_SCORE_WEIGHT": "2.5",
                                         "INFLIGHT_GATEWAY_CACHE_THRESHOLD": "0.8"})
    assert settings.router_config() == RouterConfig("shared", 2.5, 0.0, 0.8)
