"""Every query of the Grafana dashboard answers in a real Prometheus scraping the real stack.

A private Prometheus (Debian's ``prometheus`` package, which .ci/run installs) on its
own port scrapes the session stack's gateway and worker /metrics every second, with
the job names of deploy/prometheus/prometheus.yml and the rules of
deploy/prometheus/rules loaded. After a little real load (streamed requests, a bad
key, a rate-limited key) each PromQL expression of
deploy/grafana/dashboards/inflight.json goes through ``/api/v1/query``: each must
return at least one sample, and not only NaN (a panel that would stay empty). The
rules must evaluate without error, and every recording rule must have data. About
30 s on two cores (the stack itself is started once for all e2e tests).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml

from stack.clients import rest_chat_stream
from tests.helpers.redis_server import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "inflight.json"
RULES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
SCRAPE_S = 1
NUM_STREAMS = 4
# One shared opening, so later prompts hit the prefix cache.
PREFIX = ("You are a terse assistant for a monitoring test. Answer in one short sentence, "
          "without lists, and never repeat the question. ")


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or next(
        (p for p in ("/usr/bin/prometheus", "/usr/local/bin/prometheus") if Path(p).is_file()), None)


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every target, nested rows included."""
    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    dash = json.loads(DASHBOARD.read_text())
    return [(f"{p['title']} / {t.get('refId', '?')}", t["expr"])
            for p in walk(dash["panels"]) for t in p.get("targets", []) if t.get("expr")]


def substitute(expr: str, rate_interval_s: int) -> str:
    """Grafana's built-in variables as Grafana would fill them for this short test:
    ``$__rate_interval`` (at least 4 scrape intervals) and ``$__interval`` cover the whole
    time Prometheus has been scraping, ``$__range`` likewise. A variable left over
    fails the test, so a new dashboard variable has to be taught here."""
    window = f"{rate_interval_s}s"
    for var in ("__rate_interval", "__interval", "__range", "interval"):
        expr = expr.replace("${" + var + "}", window).replace("$" + var, window)
    assert "$" not in expr, f"unknown dashboard variable in {expr!r}"
    return expr


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

    def api(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def wait(self, what: str, predicate, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                got = predicate()
            except (OSError, ValueError):
                got = None
            if got:
                return got
            time.sleep(0.25)
        pytest.fail(f"timed out waiting for {what}\n{self.log.read_text()[-3000:]}")


@pytest.fixture
def prometheus(stack, tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("prometheus binary not found (Debian package `prometheus`, which .ci/run installs)")
    ends = stack.endpoints()
    gateway = urllib.parse.urlsplit(ends["gateway_rest"]).netloc
    worker = urllib.parse.urlsplit(ends["worker_metrics"]).netloc
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s",
                   "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(p) for p in RULES],
        # The job names of deploy/prometheus/prometheus.yml (the dashboard filters on them).
        "scrape_configs": [{"job_name": "inflight-gateway", "static_configs": [{"targets": [gateway]}]},
                           {"job_name": "inflight-worker", "static_configs": [{"targets": [worker]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        prom.wait("/-/ready", lambda: urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2).status == 200)

        def both_up():
            targets = prom.api("targets", state="active")["activeTargets"]
            return len(targets) == 2 and all(t["health"] == "up" for t in targets)

        prom.wait("both targets up", both_up)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def limited_key(stack) -> str:
    """A key allowed one request per minute: its second request gets 429 key_rate."""
    proc = subprocess.run([sys.executable, "-m", "inflight.cli", "keys", "create", "--redis-url", stack.redis_url,
                           "--tenant", "e2e-prometheus", "--name", "one per minute", "--rpm", "1", "--quiet"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def served(prom: Prometheus) -> float:
    result = prom.query("sum(inflight_time_to_first_token_seconds_count)")
    return float(result[0]["value"][1]) if result else -1.0


def test_every_dashboard_query_has_data(stack, api_key, rest_url, prometheus):
    started = time.monotonic()
    time.sleep(2 * SCRAPE_S)  # a baseline sample before the load, for rate()
    before = served(prometheus)
    limited = limited_key(stack)

    async def load():
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [asyncio.ensure_future(rest_chat_stream(
                rest_url, api_key, f"{PREFIX}Name a colour number {i}.", max_tokens=12,
                extra={"ignore_eos": True}, client=client)) for i in range(NUM_STREAMS)]
            first = await rest_chat_stream(rest_url, limited, f"{PREFIX}Say hi.", max_tokens=4, client=client)
            second = await rest_chat_stream(rest_url, limited, f"{PREFIX}Say hi.", max_tokens=4, client=client)
            bad = await client.post(f"{rest_url}/v1/chat/completions", headers={"Authorization": "Bearer sk-nope"},
                                    json={"messages": [{"role": "user", "content": "hi"}]})
            return await asyncio.gather(*streams), first, second, bad

    streams, first, second, bad = asyncio.run(asyncio.wait_for(load(), 240))
    assert all(r.error is None and r.completion_tokens == 12 for r in streams), [r.error for r in streams]
    assert first.error is None, first.error
    assert second.error is not None and second.error.startswith("HTTP 429"), second.error
    assert bad.status_code == 401

    # Prometheus has scraped the end of the load, and rules ran on it. A counter born at
    # the 429 needs two scrapes before rate() sees it, and a rule evaluation after them;
    # on two busy cores a scrape or an evaluation can come late, so wait for the data
    # (bounded) instead of sleeping a fixed time.
    prometheus.wait("the last requests in a scrape", lambda: served(prometheus) >= before + NUM_STREAMS + 1)
    prometheus.wait("two scrapes of the 429", lambda: prometheus.query(
        'count_over_time(inflight_gateway_rejections_total{reason="key_rate"}[1m]) >= 2'))
    recording = [r["name"] for g in prometheus.api("rules")["groups"] for r in g["rules"]
                 if r["type"] == "recording"]
    deadline = time.monotonic() + 30
    while [name for name in recording if not prometheus.query(name)] and time.monotonic() < deadline:
        time.sleep(0.5)  # the assertion below names any rule still without data
    time.sleep(2 * SCRAPE_S)
    window_s = max(4 * SCRAPE_S, math.ceil(time.monotonic() - started) + 5)

    problems = []
    exprs = dashboard_exprs()
    assert len(exprs) >= 20, exprs
    for where, expr in exprs:
        result = prometheus.query(substitute(expr, window_s))
        if not result:
            problems.append(f"{where}: empty: {expr}")
        elif all(math.isnan(float(s["value"][1])) for s in result):
            problems.append(f"{where}: only NaN: {expr}")
    assert not problems, "\n".join(problems)

    groups = prometheus.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 15 and {g["file"] for g in groups} == {str(p) for p in RULES}
    broken = [f"{r['name']}: {r.get('lastError')}" for r in rules if r["health"] != "ok"]
    assert not broken, broken
    empty = [r["name"] for r in rules if r["type"] == "recording" and not prometheus.query(r["name"])]
    assert not empty, f"recording rules without data after the load: {empty}"
    # A worker is up: the page for "no worker" must not be pending or firing.
    alerts = {a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"]}
    assert "InflightNoWorker" not in alerts, alerts
