"""The Redis Sentinel variants of the deployment, statically: compose.yaml's profile
``sentinel`` with deploy/compose.sentinel.yaml, and the kustomize overlay deploy/k8s-sentinel.

* compose: a replica and three sentinels behind the profile only (the default services
  and their secrets are untouched), the sentinels monitor the master ``redis`` under the
  name the clients' ``redis+sentinel://`` URL asks for, with a quorum a majority of them
  reaches; the override points the gateway, the workers and ``keys`` at all three with
  their own ACL users, and gives the master the Sentinel users;
* Kubernetes: the overlay builds, every object is valid, every pod keeps the restricted,
  read-only baseline and gets its credentials as Secret files, and the NetworkPolicies
  open exactly the flows replication and failover need (the base's flows all kept).

deploy/redis/sentinel.acl and redis-ha.sh run for real in test_redis_sentinel_acl.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from common.redis_connect import parse_sentinel_url
from tests.deploy.test_deploy_security import (
    allowed,
    endpoints,
    k8s_credential_problems,
    network_problems,
    pod_security_problems,
)
from tests.deploy.test_linters import _validate_k8s, check_jsonschema, keda_schema, kustomize_build

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "k8s-sentinel"
OVERRIDE = ROOT / "deploy" / "compose.sentinel.yaml"
SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")
MASTER_NAME = "inflight"
HA_SECRETS = {"redis_replication_password", "redis_sentinel_password"}


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _after(words: list[str], script: str) -> list[str]:
    """The arguments of ``sh .../script`` inside a command line."""
    i = next(i for i, w in enumerate(words) if w.endswith("/" + script))
    return words[i + 1:]


# ----------------------------------------------------------------- compose

def test_the_sentinel_profile_runs_a_replica_and_three_sentinels_on_the_master():
    services = _load(ROOT / "compose.yaml")["services"]
    profiled = {n for n, s in services.items() if "sentinel" in s.get("profiles", [])}
    assert profiled == {"redis-replica", *SENTINELS}
    replica = _after(services["redis-replica"]["entrypoint"], "redis-ha.sh")
    assert replica[0] == "server" and replica[3] == "redis"  # replicaof the default "redis"
    assert "/etc/inflight-redis/sentinel.acl" in services["redis-replica"]["entrypoint"]
    quorums = set()
    for name in SENTINELS:
        args = _after(services[name]["entrypoint"], "redis-ha.sh")
        assert args[0] == "sentinel" and args[3:5] == ["redis", MASTER_NAME], (name, args)
        quorums.add(int(args[5]))
        assert services[name]["command"] == ["--sentinel"]
        assert "26379" in services[name]["healthcheck"]["test"]
        assert {s for s in services[name]["secrets"]} == {"redis_sentinel_password"}
    assert quorums == {len(SENTINELS) // 2 + 1}


def test_the_default_services_do_not_see_the_sentinel_variant():
    doc = _load(ROOT / "compose.yaml")
    for name, service in doc["services"].items():
        if "sentinel" not in service.get("profiles", []):
            assert not HA_SECRETS & set(service.get("secrets", [])), name
            assert "redis+sentinel" not in str(service.get("command", "")) + str(service.get("entrypoint", ""))
    assert {doc["secrets"][s]["environment"] for s in HA_SECRETS} == {"REDIS_REPLICATION_PASSWORD",
                                                                      "REDIS_SENTINEL_PASSWORD"}


def test_the_override_matches_the_compose_spec_and_points_clients_at_the_sentinels():
    proc = check_jsonschema("--builtin-schema", "vendor.compose-spec", str(OVERRIDE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    base = _load(ROOT / "compose.yaml")["services"]
    override = _load(OVERRIDE)["services"]
    assert set(override) == {"redis", "gateway", "worker", "worker-cpu", "worker-tiny", "keys"}
    for name, user in (("gateway", "gateway"), ("worker", "worker"), ("worker-cpu", "worker"), ("worker-tiny", "worker"),
                       ("keys", "admin")):
        words = override[name].get("command") if name != "keys" else override[name]["entrypoint"]
        old = base[name].get("command") if name != "keys" else base[name]["entrypoint"]
        url = words[words.index("--redis-url") + 1]
        target = parse_sentinel_url(url)
        assert target.service_name == MASTER_NAME and target.username == user
        assert {h for h, _ in target.sentinels} == set(SENTINELS) and {p for _, p in target.sentinels} == {26379}
        # Everything but the URL as in compose.yaml (the password file above all).
        i = old.index("--redis-url")
        assert words[:i + 1] + words[i + 2:] == old[:i + 1] + old[i + 2:], name
        assert set(override[name]["depends_on"]) == set(SENTINELS)
    master = override["redis"]
    assert "/etc/inflight-redis/sentinel.acl" in master["entrypoint"]
    assert _after(master["entrypoint"], "redis-ha.sh")[:4] == ["server", "/run/secrets/redis_%s_password",
                                                               "/tmp/redis-ha.conf", "-"]
    assert set(master["secrets"]) == HA_SECRETS
    # The master's command line (AOF, the ACL file) is compose.yaml's, kept by the override.
    assert "command" not in master and "--aclfile" in base["redis"]["command"]


# ----------------------------------------------------------------- Kubernetes

@pytest.fixture(scope="module")
def built(tmp_path_factory) -> list[dict]:
    """``kubectl kustomize deploy/k8s-sentinel`` with placeholder credentials."""
    folder = tmp_path_factory.mktemp("deploy")
    shutil.copytree(ROOT / "deploy" / "k8s", folder / "k8s", ignore=shutil.ignore_patterns("secrets"))
    shutil.copytree(OVERLAY, folder / "k8s-sentinel", ignore=shutil.ignore_patterns("secrets"))
    for gen in _load(folder / "k8s" / "kustomization.yaml")["secretGenerator"]:
        for item in gen["files"]:
            source = folder / "k8s" / item.split("=", 1)[-1]
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_text("placeholder-not-a-secret\n")
    return kustomize_build(folder / "k8s-sentinel")


def _workload(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def test_the_overlay_builds_valid_objects(built):
    names = {(d["kind"], d["metadata"]["name"]) for d in built}
    assert {("Deployment", "inflight-redis-replica"), ("Deployment", "inflight-redis-sentinel"),
            ("Service", "inflight-redis-sentinel"), ("PodDisruptionBudget", "inflight-redis-sentinel")} <= names
    for d in built:
        if d["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's objects are the base's, schema-checked in test_linters
        _validate_k8s(d)
    assert keda_schema({"kind": "ScaledObject"}).is_file()
    secret = next(d for d in built if d["kind"] == "Secret" and d["metadata"]["name"] == "inflight-redis-passwords")
    assert set(secret["data"]) == {"gateway", "worker", "admin", "keda", "replication", "sentinel"}


def test_three_sentinels_monitor_the_master_by_name_and_clients_ask_them(built):
    sentinel = _workload(built, "inflight-redis-sentinel")
    assert sentinel["spec"]["replicas"] == 3
    args = _after(sentinel["spec"]["template"]["spec"]["containers"][0]["command"], "redis-ha.sh")
    assert args[0] == "sentinel" and args[3:6] == ["inflight-redis", MASTER_NAME, "2"]
    replica = _after(_workload(built, "inflight-redis-replica")["spec"]["template"]["spec"]["containers"][0]["command"],
                     "redis-ha.sh")
    assert replica[0] == "server" and replica[3] == "inflight-redis"
    master = _workload(built, "inflight-redis")["spec"]["template"]["spec"]
    assert "/etc/inflight-redis/sentinel.acl" in master["containers"][0]["command"]
    assert _after(master["containers"][0]["command"], "redis-ha.sh")[3] == "-"
    assert master["containers"][0]["args"] == ["--appendonly", "yes", "--aclfile", "/tmp/users.acl"]
    items = {i["key"] for v in master["volumes"] if v["name"] == "passwords" for i in v["secret"]["items"]}
    assert {"replication", "sentinel"} <= items
    pdb = next(d for d in built if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "inflight-redis-sentinel")
    assert pdb["spec"]["minAvailable"] == 2
    for name, user in (("inflight-gateway", "gateway"), ("inflight-worker", "worker")):
        words = _workload(built, name)["spec"]["template"]["spec"]["containers"][0]["args"]
        url = next(w.split("=", 1)[1] for w in words if w.startswith("--redis-url="))
        target = parse_sentinel_url(url)
        assert (target.sentinels, target.service_name, target.username) == (
            (("inflight-redis-sentinel", 26379),), MASTER_NAME, user)


def test_every_pod_keeps_the_baseline_and_its_credentials_are_secret_files(built):
    assert pod_security_problems(built) == []
    kustomizations = [_load(ROOT / "deploy" / "k8s" / "kustomization.yaml"), _load(OVERLAY / "kustomization.yaml")]
    assert k8s_credential_problems([d for d in built if d["kind"] != "Secret"] + kustomizations) == []
    ignore = (OVERLAY / "secrets" / ".gitignore").read_text().split()
    assert "*" in ignore and "!.gitignore" in ignore


#: Replication and failover: (source, destination, port) that must be open ...
SENTINEL_FLOWS = [
    ("gateway", "redis-sentinel", 26379), ("worker", "redis-sentinel", 26379),
    ("gateway", "redis-replica", 6379), ("worker", "redis-replica", 6379), ("keda", "redis-replica", 6379),
    ("redis-sentinel", "redis", 6379), ("redis-sentinel", "redis-replica", 6379),
    ("redis-sentinel", "redis-sentinel", 26379),
    ("redis-replica", "redis", 6379), ("redis", "redis-replica", 6379),
]
#: ... and a sample of what stays shut.
SENTINEL_SHUT = [
    ("stranger", "redis-sentinel", 26379), ("stranger", "redis-replica", 6379), ("edge", "redis-sentinel", 26379),
    ("outsider", "redis-sentinel", 26379), ("prometheus", "redis-replica", 6379),
    ("redis-sentinel", "gateway", 50052), ("redis-sentinel", "internet", 443), ("redis-replica", "internet", 443),
    ("redis-replica", "redis-sentinel", 26379), ("keda", "redis-sentinel", 26379), ("gateway", "redis", 26379),
]


def test_network_policies_allow_the_sentinel_flows_and_keep_the_rest(built):
    assert network_problems(built) == []  # the base's flows, the default deny, a policy per pod
    ends = endpoints(built)
    shut = [f for f in SENTINEL_FLOWS if not allowed(built, ends[f[0]], ends[f[1]], f[2])]
    opened = [f for f in SENTINEL_SHUT if allowed(built, ends[f[0]], ends[f[1]], f[2])]
    assert (shut, opened) == ([], [])
