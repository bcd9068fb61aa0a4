"""The pieces of the CI compose check (deploy/ci/compose_check.sh) that need no podman:
one set of Dockerfiles whose base image is a build argument, the services built from
Debian's packages, Grafana behind its profile, and the derived compose file that
podman-compose 1.0.3 is given (deploy/ci/compose_check.py). The check itself runs the
images for real; it is a CI step, not a test (it takes minutes and root)."""

from __future__ import annotations

import importlib.util
import re
import stat
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _check_module():
    spec = importlib.util.spec_from_file_location("compose_check", ROOT / "deploy" / "ci" / "compose_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _built() -> dict[str, Path]:
    return {name: ROOT / s["build"]["context"] / s["build"]["dockerfile"]
            for name, s in _compose()["services"].items() if "build" in s}


@pytest.mark.parametrize("name", sorted(_built()))
def test_every_built_image_takes_its_base_as_a_build_argument(name):
    text = _built()[name].read_text()
    first_from = text.index("\nFROM ")
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text[:first_from], re.M))
    stage = _compose()["services"][name]["build"].get("target")
    base_arg = "CUDA_BASE_IMAGE" if stage == "gpu" else "BASE_IMAGE"
    assert base_arg in args, (name, args)
    assert re.search(rf"^FROM \$\{{{base_arg}\}}( AS {stage})?$" if stage else rf"^FROM \$\{{{base_arg}\}}$",
                     text, re.M), name
    # a default a Docker user gets from a registry: the official images
    assert args[base_arg].split(":")[0] in {"python", "debian", "nvidia/cuda"}, args[base_arg]


def test_ci_builds_every_service_it_runs_and_grafana_is_a_profile():
    module = _check_module()
    services = _compose()["services"]
    assert set(module.BUILDS) | set(module.SAME_IMAGE) == set(module.SERVICES)
    for name in module.SERVICES:
        assert "build" in services[name] and "profiles" not in services[name] or name == "worker-cpu", name
    for name, twin in module.SAME_IMAGE.items():  # built once, as its twin
        assert (services[name]["image"], services[name]["build"]) == (services[twin]["image"], services[twin]["build"])
    assert services["grafana"]["profiles"] == ["grafana"] and "build" not in services["grafana"]
    for name in ("redis", "nginx", "prometheus"):
        assert "apt-get install" in _built()[name].read_text(), f"{name}: from Debian's package"


def test_python_images_install_from_the_wheelhouse_when_it_has_a_pip_conf():
    for name in ("gateway", "worker-cpu"):
        text = _built()[name].read_text().split(" AS gpu")[0]  # the gpu stage is not built in CI
        assert "PIP_CONFIG_FILE=/wheels/pip.conf" in text, name
        pip_runs = [r for r in re.split(r"\n(?=[A-Z]+ )", text) if r.startswith("RUN") and "pip install" in r]
        assert pip_runs and all("--mount=type=bind,source=deploy/wheelhouse,target=/wheels" in r for r in pip_runs)
    assert (ROOT / "deploy" / "wheelhouse" / "README.md").is_file()
    assert "deploy/wheelhouse" not in (ROOT / ".dockerignore").read_text()


def test_derived_compose_file_is_what_podman_compose_1_0_3_can_run(tmp_path):
    module = _check_module()
    run = module.Run(tmp_path, keep=False, reuse=False)
    doc = module.derived_compose(run)
    assert list(doc["services"]) == module.DERIVED_SERVICES
    values = set()
    for name, secret in doc["secrets"].items():
        assert set(secret) == {"file"}, (name, secret)
        path = Path(secret["file"])
        assert path.parent.stat().st_mode & 0o777 == 0o700
        assert not path.stat().st_mode & stat.S_IWOTH
        values.add(path.read_text().strip())
        assert len(path.read_text().strip()) == 64
    assert len(values) == len(doc["secrets"]) >= 4  # a fresh value each
    published = []
    for name, svc in doc["services"].items():
        assert "profiles" not in svc
        assert ("build" in svc) == (name in module.BUILDS or name == "keys"), name  # SAME_IMAGE: not built twice
        if "build" in svc:
            assert Path(svc["build"]["context"]).is_absolute()
            assert svc["build"]["args"]["BASE_IMAGE"] in (module.DEBIAN_BASE, module.PYTHON_BASE)
        original = _compose()["services"][name].get("volumes", [])
        assert len(svc.get("volumes", [])) == len(original)
        for vol, orig in zip(svc.get("volumes", []), original):
            source, _, rest = vol.partition(":")
            assert rest == orig.partition(":")[2], (vol, orig)  # target and options kept
            assert not source.startswith(".") and (Path(source).exists() or "/" not in source), vol
        for port in svc.get("ports", []):
            host, host_port, inner = port.split(":")
            assert host == "127.0.0.1"
            published.append(int(host_port))
            assert run.ports[(name, int(inner))] == int(host_port)
    assert len(published) == len(set(published)) == len(run.ports)
    assert {("nginx", 8080), ("nginx", 8081), ("prometheus", 9090)} <= set(run.ports)
