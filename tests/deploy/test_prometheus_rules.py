"""The Prometheus config and rules under deploy/prometheus, checked by promtool:

* ``promtool check config`` on prometheus.yml (it also loads every rule file it lists);
* ``promtool check rules`` on rules/*.yml;
* ``promtool test rules`` on tests/*.yml: unit tests of every alert with input series;
* a test file expecting an alert that cannot fire must fail, so a promtool that
  silently runs nothing fails here.

promtool comes with Debian's ``prometheus`` package (.ci/run installs it); without
it those tests skip, saying so. The checks that need no promtool (each rule file is
loaded by compose and Kubernetes, the ConfigMap copy is fresh, metric names exist)
always run. About 3 s.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
TEST_FILES = sorted((PROM / "tests").glob("*.yml"))


def promtool() -> str:
    found = shutil.which("promtool") or next((p for p in ("/usr/bin/promtool", "/usr/local/bin/promtool")
                                              if Path(p).is_file()), None)
    if found is None:
        pytest.skip("promtool not installed (Debian package `prometheus`, which .ci/run installs)")
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    proc.output = proc.stdout + proc.stderr
    return proc


def test_rule_and_test_files_exist():
    assert {p.name for p in RULE_FILES} >= {"recording.yml", "alerts.yml"}
    assert TEST_FILES


def test_promtool_check_config_loads_every_rule_file():
    proc = run_promtool("check", "config", str(PROM / "prometheus.yml"))
    assert proc.returncode == 0, proc.output
    assert f"{len(RULE_FILES)} rule files found" in proc.output, proc.output


def test_promtool_check_rules():
    proc = run_promtool("check", "rules", *map(str, RULE_FILES))
    assert proc.returncode == 0, proc.output


def test_promtool_test_rules():
    proc = run_promtool("test", "rules", *map(str, TEST_FILES))
    assert proc.returncode == 0, proc.output
    assert "SUCCESS" in proc.output


def test_promtool_test_rules_fails_a_wrong_expectation(tmp_path):
    """An idle queue raising InflightQueueGrowing is wrong: promtool must say so."""
    test = {"rule_files": [str(p) for p in RULE_FILES], "evaluation_interval": "1m",
            "tests": [{"interval": "1m",
                       "input_series": [{"series": 'inflight_queue_depth{priority="1"}', "values": "0x30"}],
                       "alert_rule_test": [{"eval_time": "25m", "alertname": "InflightQueueGrowing",
                                            "exp_alerts": [{"exp_labels": {"severity": "ticket", "priority": "1"}}]}]}]}
    path = tmp_path / "wrong_test.yml"
    path.write_text(yaml.safe_dump(test))
    proc = run_promtool("test", "rules", str(path))
    assert proc.returncode != 0 and "FAILED" in proc.output, proc.output


def test_every_alert_has_a_unit_test():
    alerts = {r["alert"] for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for f in TEST_FILES for case in yaml.safe_load(f.read_text())["tests"]
              for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert alerts >= {"InflightQueueGrowing", "InflightKVCacheNearFull", "InflightNoWorker",
                      "InflightGateway5xxRate", "InflightKeyRateLimited", "InflightQueueFullRejections", "InflightTTFTBudgetBurnFast",
                      "InflightTTFTBudgetBurnSlow", "InflightRedisDown"}
    assert alerts <= tested, f"alerts never seen firing in a test: {sorted(alerts - tested)}"


def test_rules_use_only_exported_metrics():
    import re

    sources = (ROOT / "gateway" / "metrics.py").read_text() + (ROOT / "worker" / "serve" / "metrics.py").read_text()
    names = {m for f in RULE_FILES for m in re.findall(r"\binflight_[a-z0-9_]+", f.read_text())}
    assert len(names) >= 8, names

    def exported(name: str) -> bool:  # as is, or less a sample suffix (a gauge may end in _total)
        return any(f'"{n}"' in sources for n in (name, re.sub(r"_(total|bucket|sum|count|created)$", "", name)))

    missing = sorted(n for n in names if not exported(n))
    assert not missing, f"not exported by gateway/metrics.py or worker/serve/metrics.py: {missing}"


def test_compose_mounts_the_rules_where_the_config_looks():
    conf = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert conf["rule_files"] == ["rules/*.yml"]  # relative to the config file
    service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["prometheus"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in service["volumes"] if v.startswith(".")}
    config_dir = Path(mounts["./deploy/prometheus/prometheus.yml"]).parent
    assert mounts["./deploy/prometheus/rules"] == str(config_dir / "rules")


def test_k8s_configmap_carries_every_rule_file_unchanged():
    sys.path.insert(0, str(ROOT / "deploy"))
    import render_k8s_rules

    assert render_k8s_rules.OUTPUT.read_text() == render_k8s_rules.render(), \
        "run python deploy/render_k8s_rules.py"
    doc = yaml.safe_load(render_k8s_rules.OUTPUT.read_text())
    assert doc["kind"] == "ConfigMap"
    assert doc["data"] == {p.name: p.read_text() for p in RULE_FILES}
    kustomization = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())
    assert render_k8s_rules.OUTPUT.name in kustomization["resources"]
