"""``min_tokens`` under a structured-outputs constraint: the worker masks EOS until then while
the grammar allows another token and ends the request once the output is complete, as vLLM's
terminal grammars do; a ``choice`` whose longest string can never reach ``min_tokens`` was
answered with a shorter output, silently (a user read it as min_tokens ignored): now a 400
naming both fields, nothing queued."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway.conftest import wait_for

CHAT = {"messages": [{"role": "user", "content": "Is water wet?"}], "max_tokens": 16}


def _post(gateway, api_key, body):
    return httpx.post(gateway.rest_url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {api_key}"}, timeout=30)


@pytest.mark.parametrize("constraint,param", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs.choice"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
])
def test_min_tokens_a_choice_can_never_reach_is_a_400_naming_both(gateway, api_key, fake_worker, constraint, param):
    n = len(fake_worker.requests)
    r = _post(gateway, api_key, {**CHAT, **constraint, "min_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "min_tokens" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"'min_tokens' (4) cannot be met under '{param}'"), error
    assert len(fake_worker.requests) == n


def test_min_tokens_a_constraint_may_reach_is_passed_to_the_worker(gateway, api_key, fake_worker):
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 3},
                  {"structured_outputs": {"regex": "[0-9]+"}, "min_tokens": 12}):
        n = len(fake_worker.requests)
        r = _post(gateway, api_key, {**CHAT, **extra})
        assert r.status_code == 200, r.text
        assert wait_for(lambda: len(fake_worker.requests) > n)
        assert fake_worker.requests[-1].sampling.min_tokens == extra["min_tokens"]
