"""`inflight status` and the gateway's GET /fleet against the real stack (SmolLM2, nginx):
one collector (common/fleet.py), so both show the worker, its model, the queues and the
429s a key just got; /fleet needs an admin key."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from common.promtext import sample_sum


def _status(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inflight.cli", "status", "--redis-url", stack.redis_url, *args],
                          capture_output=True, text=True, timeout=60)


def _rate_limited_key(stack, rest_url: str, rejected: int) -> str:
    """A key of 1 request/min, spent, then refused ``rejected`` times (429 key_rate); its id."""
    key = stack.create_key(tenant="fleet", name="rpm1")
    body = {"prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=rest_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        key_id = _key_id(stack, key)
        subprocess.run([sys.executable, "-m", "inflight.cli", "keys", "set", key_id, "--rpm", "1", "--redis-url",
                        stack.redis_url], check=True, capture_output=True, timeout=60)
        assert client.post("/v1/completions", json=body).status_code == 200
        for _ in range(rejected):
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 429 and resp.json()["error"]["code"] == "key_rate", resp.text
    return key_id


def _key_id(stack, plaintext: str) -> str:
    import redis

    from gateway.keys import hash_key

    client = redis.Redis.from_url(stack.redis_url)
    return client.hget(f"inflight:keys:hash:{hash_key(plaintext)}", "key_id").decode()


def test_status_json_and_table_show_the_worker_queues_and_the_429s_just_given(stack, rest_url):
    key_id = _rate_limited_key(stack, rest_url, rejected=2)
    gateway_metrics = httpx.get(f"{stack.endpoints()['gateway_rest']}/metrics").text
    assert sample_sum(gateway_metrics, "inflight_gateway_key_admissions_total",
                      {"key_id": key_id, "outcome": "key_rate"}) == 2
    out = _status(stack, "--json")
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    (worker,) = view["workers"]
    assert worker["model"].startswith("SmolLM2-135M-Instruct") and worker["source"] == "metrics"
    assert worker["metrics_url"] == stack.endpoints()["worker_metrics"]
    assert set(view["queue_depth"]) == {"0", "1", "2"}
    assert view["rejections_last_minute"].get("key_rate", 0) >= 2  # this test's two, and any of the last minute
    table = _status(stack)
    assert table.returncode == 0, table.stderr
    assert worker["worker_id"] in table.stdout and "429s in the last minute: key_rate" in table.stdout


def test_fleet_endpoint_through_nginx_needs_an_admin_key(stack, rest_url, api_key):
    assert httpx.get(f"{rest_url}/fleet").status_code == 401
    denied = httpx.get(f"{rest_url}/fleet", headers={"Authorization": f"Bearer {api_key}"})
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_key_required"
    admin = stack.create_key(tenant="ops", name="admin", admin=True)
    resp = httpx.get(f"{rest_url}/fleet", headers={"Authorization": f"Bearer {admin}"})
    assert resp.status_code == 200, resp.text
    view = resp.json()
    assert [w["model"][:21] for w in view["workers"]] == ["SmolLM2-135M-Instruct"]
    assert set(view) == {"taken_unix_s", "workers", "queue_depth", "rejections_last_minute", "prompt_tps",
                         "generation_tps"}


def test_the_worker_logs_vllms_stats_line_every_10_s(stack):
    """worker/serve/stats_logger.py through the real worker loop: the line is in its log."""
    import time

    log = stack.settings.run_dir / "worker.log"
    deadline = time.monotonic() + 15  # one 10 s interval after the worker's first loop
    while "inflight.stats: Avg prompt throughput: " not in log.read_text():
        assert time.monotonic() < deadline, "no stats line in the worker's log"
        time.sleep(0.5)
    line = next(x for x in log.read_text().splitlines() if "inflight.stats: Avg prompt throughput: " in x)
    assert "Running: " in line and "Waiting: " in line and "KV cache usage: " in line
