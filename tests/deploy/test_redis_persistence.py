"""Redis runs with AOF persistence in compose and Kubernetes, so queued requests, API keys
and the consumer group survive a Redis restart (deploy/README.md, tests/e2e/test_redis_restart.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _appendonly(args: list[str]) -> str | None:
    args = [str(a) for a in args]
    return args[args.index("--appendonly") + 1] if "--appendonly" in args[:-1] else None


def test_compose_redis_uses_aof_on_a_volume():
    redis = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    assert _appendonly(redis["command"]) == "yes"
    assert any(str(v).endswith(":/data") for v in redis.get("volumes", []))


def test_k8s_redis_uses_aof():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "redis.yaml").read_text()))
    deployment = next(d for d in docs if d and d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert _appendonly(container.get("args", [])) == "yes"
    assert any(m["mountPath"] == "/data" for m in container.get("volumeMounts", []))
