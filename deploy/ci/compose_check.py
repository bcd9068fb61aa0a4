"""The compose stack for real, with podman-compose (CI; run by deploy/ci/compose_check.sh,
which prepares podman and deploy/wheelhouse first).

Steps, each timed: a Debian bookworm base image from ``debootstrap --variant=minbase``
(``podman import``), the python base on it (deploy/ci/debian-python.Dockerfile); the
images of compose.yaml's redis, nginx, prometheus, gateway and worker-cpu built by
``podman-compose build`` with that base as their ``BASE_IMAGE`` (worker-tiny runs
worker-cpu's image); the gateway image checked free of torch; ``podman-compose up``; every
service's own compose healthcheck run until it passes; an API key made by compose's ``keys``
service (``inflight keys create``, the Redis user admin); a REST stream with the ``openai``
client and a gRPC stream through the nginx edge; the two models behind the one gateway
(issue 44): ``/v1/models`` through nginx lists SmolLM2 and tiny-random, and each answers a
chat completion; Prometheus' targets all up (its HTTP API); the worker container killed
with SIGKILL in the middle of a stream, restarted by its compose ``restart:`` policy, and
the stream finished on it with exactly the text of an uninterrupted run; ``podman-compose
down``. On a failure every container's log is printed. Everything it made (containers,
volumes, network, images) is removed at the end, unless ``--keep`` (images kept).

podman-compose 1.0.3 (Debian bookworm) lacks three things compose.yaml uses, so it is
given a derived file (printed, then kept in the work directory): only the services
checked (no profiles in 1.0.3), each ``environment:`` secret as a ``file:`` secret holding
a fresh random value, build contexts and bind mounts as absolute paths, published ports on
free ports of 127.0.0.1 (other stacks may hold the defaults), ``BASE_IMAGE`` build args.
Health conditions of ``depends_on`` are not enforced by 1.0.3: the services retry or
restart until their dependencies answer, and the checks wait on the healthchecks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stack.clients import grpc_chat_stream  # noqa: E402  (after the path insert)

PROJECT = "inflight-ci"
DEBIAN_BASE = "localhost/inflight-ci/debian:bookworm"
PYTHON_BASE = "localhost/inflight-ci/python:bookworm"
#: service -> the BASE_IMAGE its Dockerfile is built on.
BUILDS = {"redis": DEBIAN_BASE, "nginx": DEBIAN_BASE, "prometheus": DEBIAN_BASE,
          "gateway": PYTHON_BASE, "worker-cpu": PYTHON_BASE}
#: service -> the built service whose image it runs (built once: no layer cache here).
SAME_IMAGE = {"worker-tiny": "worker-cpu"}
SERVICES = ["redis", "gateway", "worker-cpu", "worker-tiny", "nginx", "prometheus"]
DERIVED_SERVICES = SERVICES + ["keys"]
READY_TIMEOUT_S = 600.0     # first start: model load + warm-up on 2 busy cores
RESTART_TIMEOUT_S = 300.0   # the killed worker back and the stream finished
KEY = re.compile(r"\bsk-inflight-[A-Za-z0-9_-]{20,}")
PROMPT = "Write a long story about a lighthouse keeper and the sea."
KILL_MAX_TOKENS = 160
#: compose.yaml's two models: the gateway's --model flags, the default one first.
DEFAULT_MODEL, SECOND_MODEL = "SmolLM2-135M-Instruct", "tiny-random"


class CheckFailed(Exception):
    """A step of the check failed; the message says which and why."""


@dataclass
class Run:
    """One check: its work directory, the derived compose file and host ports."""

    work: Path
    keep: bool
    reuse: bool
    compose_file: Path = field(init=False)
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    timings: list[tuple[str, float]] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.compose_file = self.work / "compose.podman.yaml"


def sh(*args: str, timeout: float = 900, check: bool = True, quiet: bool = False,
       input_text: str | None = None) -> subprocess.CompletedProcess:
    """Run ``args``; output printed unless ``quiet`` (then kept in the result).

    Raises:
        CheckFailed: non-zero exit with ``check``, or ``timeout`` seconds passed.
    """
    try:
        proc = subprocess.run(args, text=True, timeout=timeout, input=input_text,
                              stdin=subprocess.DEVNULL if input_text is None else None,
                              stdout=subprocess.PIPE if quiet else None,
                              stderr=subprocess.STDOUT if quiet else None)
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"{' '.join(args[:4])}...: no end after {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        raise CheckFailed(f"{' '.join(args)}: exit {proc.returncode}\n{proc.stdout or ''}")
    return proc


def compose(run: Run, *args: str, timeout: float = 900, check: bool = True,
            quiet: bool = False) -> subprocess.CompletedProcess:
    """``podman-compose -p inflight-ci -f <derived file> ARGS``."""
    return sh("podman-compose", "-p", PROJECT, "-f", str(run.compose_file), *args,
              timeout=timeout, check=check, quiet=quiet)


@contextmanager
def step(run: Run, name: str):
    """Print and time one step."""
    print(f"\n=== compose check: {name}", flush=True)
    start = time.monotonic()
    yield
    run.timings.append((name, time.monotonic() - start))
    print(f"=== {name}: {time.monotonic() - start:.0f} s", flush=True)


def container(service: str) -> str:
    """podman-compose 1.0.3's container name of ``service``."""
    return f"{PROJECT}_{service}_1"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, probe: Callable[[], bool], timeout_s: float, every_s: float = 2.0) -> None:
    """Call ``probe`` until it returns True.

    Raises:
        CheckFailed: ``timeout_s`` seconds passed first.
    """
    deadline = time.monotonic() + timeout_s
    while not probe():
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


# ----------------------------------------------------------------- derived file

def absolute_mount(volume: str) -> str:
    """A short-syntax mount with a relative source (``./a:/b:ro``) as an absolute one."""
    source, sep, rest = volume.partition(":")
    return str((ROOT / source).resolve()) + sep + rest if source.startswith(".") else volume


def derived_compose(run: Run) -> dict:
    """compose.yaml as podman-compose 1.0.3 can run it (module docstring)."""
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = {name: doc["services"][name] for name in DERIVED_SERVICES}
    secret_dir = run.work / "secrets"
    secret_dir.mkdir(mode=0o700)
    used = {s if isinstance(s, str) else s["source"] for svc in services.values() for s in svc.get("secrets", [])}
    declared = {}
    for name in sorted(used):
        spec = doc["secrets"][name]
        if "environment" in spec:
            path = secret_dir / name
            path.write_text(secrets.token_hex(32) + "\n")
            path.chmod(0o644)  # read by the services' own users inside the containers
            declared[name] = {"file": str(path)}
        else:
            declared[name] = {"file": str((ROOT / spec["file"]).resolve())}
    for name, svc in services.items():
        svc.pop("profiles", None)
        if name in SAME_IMAGE:  # the image its twin builds; podman-compose up never builds it again
            svc.pop("build", None)
        if "build" in svc:
            svc["build"]["context"] = str((ROOT / svc["build"].get("context", ".")).resolve())
            svc["build"]["args"] = {"BASE_IMAGE": BUILDS["gateway" if name == "keys" else name]}
        svc["volumes"] = [absolute_mount(v) for v in svc.get("volumes", [])]
        if not svc["volumes"]:
            del svc["volumes"]
        published = []
        for spec in svc.get("ports", []):
            inner = int(str(spec).split(":")[-1])
            run.ports[(name, inner)] = free_port()
            published.append(f"127.0.0.1:{run.ports[(name, inner)]}:{inner}")
        if published:
            svc["ports"] = published
    return {"services": services, "secrets": declared, "volumes": doc.get("volumes", {})}


# ----------------------------------------------------------------- images

def make_base_images(run: Run) -> None:
    """DEBIAN_BASE from debootstrap (the mirror apt uses), PYTHON_BASE built on it."""
    rootfs = run.work / "rootfs"
    mirror = "http://deb.debian.org/debian"
    retry("debootstrap", lambda: sh("debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror,
                                    timeout=600, quiet=True), cleanup=lambda: shutil.rmtree(rootfs, ignore_errors=True))
    (rootfs / "etc/apt/sources.list").write_text(
        f"deb {mirror} bookworm main\ndeb {mirror} bookworm-updates main\n"
        "deb http://deb.debian.org/debian-security bookworm-security main\n")
    slim(rootfs)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imp = subprocess.run(["podman", "import", "--change", 'CMD ["/bin/bash"]', "-", DEBIAN_BASE],
                         stdin=tar.stdout, capture_output=True, text=True, timeout=300)
    tar.stdout.close()
    if tar.wait() != 0 or imp.returncode != 0:
        raise CheckFailed(f"podman import: {imp.stderr}")
    shutil.rmtree(rootfs)
    sh("podman", "build", "-f", str(ROOT / "deploy/ci/debian-python.Dockerfile"), "--build-arg",
       f"BASE_IMAGE={DEBIAN_BASE}", "-t", PYTHON_BASE, str(ROOT / "deploy/ci"), timeout=600)


#: What the official debian:*-slim images leave out, for this base and every package
#: installed on it later (dpkg path filters): documentation, manual pages, translations.
DPKG_SLIM = """path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
"""
#: ... and apt keeps no downloaded packages or caches (as those images' docker-clean).
APT_CLEAN = """DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
"""


def slim(rootfs: Path) -> None:
    """The rootfs without package caches, lists and documentation; dpkg and apt keep it so."""
    (rootfs / "etc/dpkg/dpkg.cfg.d/slim").write_text(DPKG_SLIM)
    (rootfs / "etc/apt/apt.conf.d/docker-clean").write_text(APT_CLEAN)
    sh("find", str(rootfs / "usr/share/doc"), "-mindepth", "1", "-not", "-type", "d", "-not", "-name", "copyright",
       "-delete", quiet=True)
    for folder in ("var/cache/apt", "var/lib/apt/lists", "usr/share/man", "usr/share/info", "usr/share/locale"):
        sh("find", str(rootfs / folder), "-mindepth", "1", "-not", "-type", "d", "-delete", quiet=True)


def image_exists(name: str) -> bool:
    return sh("podman", "image", "exists", name, check=False, quiet=True).returncode == 0


def build_images(run: Run, images: dict[str, str]) -> None:
    """``podman-compose build`` for each service in BUILDS; podman-compose 1.0.3 does not
    pass a failed build's exit status on, so each image must exist afterwards."""
    for service in BUILDS:
        if not (run.reuse and image_exists(images[service])):
            with step(run, f"build {service} ({images[service]})"):
                retry(f"build of {service}", lambda: build_one(run, service, images[service]))
        size = json.loads(sh("podman", "image", "inspect", images[service], quiet=True).stdout)[0]["Size"]
        run.sizes[service] = size


def build_one(run: Run, service: str, image: str) -> None:
    """``podman-compose build SERVICE``.

    Raises:
        CheckFailed: no ``image`` afterwards (the build's output is above).
    """
    compose(run, "build", service, timeout=900)
    if not image_exists(image):
        raise CheckFailed(f"build of {service}: no image {image} (its output is above)")


def retry(what: str, action: Callable[[], object], attempts: int = 2,
          cleanup: Callable[[], object] | None = None) -> None:
    """``action()``, once more after a failure: the steps that download from the Debian
    mirror (debootstrap, apt in the builds) may meet a network hiccup. A real breakage
    (a broken Dockerfile) fails both attempts and so the check.

    Raises:
        CheckFailed: the last attempt's failure.
    """
    for attempt in range(1, attempts + 1):
        try:
            action()
            return
        except CheckFailed as exc:
            if attempt == attempts:
                raise
            print(f"\n{what} failed (attempt {attempt} of {attempts}), trying again: {exc}", flush=True)
            if cleanup is not None:
                cleanup()


def check_gateway_has_no_torch(image: str) -> None:
    """torch is not even installed in the gateway image."""
    probe = "import importlib.util, sys; sys.exit(3 if importlib.util.find_spec('torch') else 0)"
    proc = sh("podman", "run", "--rm", "--entrypoint", "python", image, "-c", probe, check=False, quiet=True)
    if proc.returncode != 0:
        raise CheckFailed(f"gateway image: torch importable or probe failed (exit {proc.returncode}): {proc.stdout}")


# ----------------------------------------------------------------- running stack

def healthcheck(service: str, spec: dict) -> bool:
    """Run the service's compose healthcheck in its container; True when it passes."""
    test = spec["test"]
    cmd = list(test[1:]) if test[0] == "CMD" else ["sh", "-c", test[1]]
    proc = subprocess.run(["podman", "exec", container(service), *cmd], capture_output=True, timeout=30)
    return proc.returncode == 0


def wait_healthy(run: Run, timeout_s: float) -> None:
    """Every service's own compose healthcheck passes."""
    specs = {name: svc["healthcheck"] for name, svc in derived_services(run).items()
             if name in SERVICES and "healthcheck" in svc}
    pending = dict(specs)

    def probe() -> bool:
        for name in list(pending):
            if healthcheck(name, pending[name]):
                print(f"    {name}: healthy", flush=True)
                del pending[name]
        return not pending

    try:
        wait_for("healthchecks", probe, timeout_s, every_s=3.0)
    except CheckFailed as exc:
        raise CheckFailed(f"{exc}; still failing: {sorted(pending)}") from exc


def derived_services(run: Run) -> dict:
    return yaml.safe_load(run.compose_file.read_text())["services"]


def create_key(run: Run) -> str:
    """A key made by compose's ``keys`` service (``inflight keys create``, Redis user admin)."""
    proc = compose(run, "run", "--rm", "--no-deps", "-T", "keys", "create", "--tenant", "compose-ci",
                   "--quiet", timeout=120, quiet=True)
    found = KEY.findall(proc.stdout)
    if not found:
        raise CheckFailed(f"keys create printed no key:\n{proc.stdout}")
    return found[-1]


def openai_stream(base_url: str, key: str, max_tokens: int, ignore_eos: bool = False,
                  on_text: Callable[[str], None] | None = None) -> tuple[str, str | None, int]:
    """One streamed chat completion with the ``openai`` client: (text, finish reason,
    completion tokens from the final usage chunk)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=key, timeout=600.0, max_retries=0)
    text, finish, tokens = "", None, 0
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", stream=True, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": PROMPT}], stream_options={"include_usage": True},
        extra_body={"ignore_eos": ignore_eos})
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            if on_text is not None and choice.delta.content:
                on_text(text)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return text, finish, tokens


def check_edge(run: Run, key: str) -> None:
    """A REST stream (openai client) and a gRPC stream through nginx."""
    rest = f"http://127.0.0.1:{run.ports[('nginx', 8080)]}/v1"
    text, finish, tokens = openai_stream(rest, key, 24)
    print(f"    REST via nginx (openai): {tokens} tokens, finish {finish}: {text[:60]!r}...")
    if not text or finish not in ("stop", "length") or tokens < 1:
        raise CheckFailed(f"REST stream through nginx: text={text!r} finish={finish} tokens={tokens}")
    grpc_addr = f"127.0.0.1:{run.ports[('nginx', 8081)]}"
    result = asyncio.run(grpc_chat_stream(grpc_addr, key, PROMPT, max_tokens=24, timeout_s=300))
    print(f"    gRPC via nginx: {result.completion_tokens} tokens, finish {result.finish_reason}, error {result.error}")
    if result.error or not result.text or result.completion_tokens < 1:
        raise CheckFailed(f"gRPC stream through nginx: {result}")


def check_two_models(run: Run, key: str) -> None:
    """``/v1/models`` through nginx lists both of compose.yaml's models as served (a ready
    worker each, not scale-from-zero), and each answers a chat completion under its own name."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{run.ports[('nginx', 8080)]}/v1", api_key=key, timeout=300.0,
                    max_retries=0)
    cards = {m.id: m for m in client.models.list()}
    print(f"    /v1/models via nginx: {sorted(cards)}", flush=True)
    for model in (DEFAULT_MODEL, SECOND_MODEL):
        if model not in cards or (cards[model].model_extra or {}).get("scale_from_zero"):
            raise CheckFailed(f"/v1/models: {model} not listed as served: {[m.model_dump() for m in cards.values()]}")
        reply = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Hi"}],
                                               extra_body={"ignore_eos": True})
        tokens = reply.usage.completion_tokens if reply.usage else 0
        print(f"    chat via nginx, {model}: {tokens} tokens, finish {reply.choices[0].finish_reason}: "
              f"{reply.choices[0].message.content!r}", flush=True)
        if reply.model != model or tokens < 1 or reply.choices[0].finish_reason != "length":
            raise CheckFailed(f"chat completion of {model}: {reply.model_dump()}")


def prometheus_targets_up(run: Run) -> bool:
    """Every target of Prometheus' scrape jobs is up, with at least one per job."""
    url = f"http://127.0.0.1:{run.ports[('prometheus', 9090)]}/api/v1/targets"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            targets = json.load(resp)["data"]["activeTargets"]
    except OSError:
        return False
    jobs: dict[str, list[str]] = {}
    for t in targets:
        jobs.setdefault(t["labels"]["job"], []).append(t["health"])
    print(f"    prometheus targets: {jobs}", flush=True)
    wanted = {"inflight-gateway", "inflight-worker", "prometheus"}
    return wanted <= set(jobs) and all(h == "up" for j in wanted for h in jobs[j])


def container_state(service: str) -> dict:
    out = sh("podman", "inspect", container(service), quiet=True).stdout
    return json.loads(out)[0]


def check_worker_kill(run: Run, key: str) -> None:
    """SIGKILL the worker container mid-stream; its restart policy brings it back and the
    stream ends with exactly the uninterrupted run's text (greedy, ignore_eos)."""
    rest = f"http://127.0.0.1:{run.ports[('nginx', 8080)]}/v1"
    reference = openai_stream(rest, key, KILL_MAX_TOKENS, ignore_eos=True)
    before = container_state("worker-cpu")
    streaming = threading.Event()
    outcome: dict[str, object] = {}

    def client() -> None:
        try:
            outcome["result"] = openai_stream(rest, key, KILL_MAX_TOKENS, ignore_eos=True,
                                              on_text=lambda t: len(t) > 20 and streaming.set())
        except Exception as exc:  # reported below
            outcome["error"] = exc
        streaming.set()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    if not streaming.wait(120) or "result" in outcome or "error" in outcome:
        raise CheckFailed(f"the stream to interrupt ended or never started: {outcome}")
    pid = before["State"]["Pid"]
    print(f"    killing the worker container's process {pid} (SIGKILL) mid-stream", flush=True)
    os.kill(pid, signal.SIGKILL)
    thread.join(RESTART_TIMEOUT_S)
    if thread.is_alive() or "error" in outcome:
        raise CheckFailed(f"the interrupted stream did not finish: {outcome or 'still running'}")
    after = container_state("worker-cpu")
    print(f"    worker container: restarts {before.get('RestartCount')} -> {after.get('RestartCount')}, "
          f"pid {pid} -> {after['State']['Pid']}")
    if after["State"]["Pid"] == pid or after.get("RestartCount", 0) <= before.get("RestartCount", 0):
        raise CheckFailed("the worker container was not restarted by its restart policy")
    if outcome["result"] != reference:
        raise CheckFailed(f"resumed stream differs from the uninterrupted one:\n{outcome['result']}\n{reference}")
    logs = sh("podman", "logs", container("gateway"), quiet=True).stdout
    if "continuation queued" not in logs:
        raise CheckFailed("the gateway log has no 'continuation queued' line")
    print(f"    stream finished on the restarted worker: {reference[2]} tokens, same text as uninterrupted")


# ----------------------------------------------------------------- logs, cleanup

def project_containers() -> list[str]:
    out = sh("podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={PROJECT}",
             "--format", "{{.Names}}", check=False, quiet=True).stdout
    return [n for n in out.split() if n]


def print_logs() -> None:
    """Every container's state and log (on a failure)."""
    sh("podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={PROJECT}", check=False)
    for name in project_containers():
        print(f"\n----- podman logs {name}", flush=True)
        sh("podman", "logs", name, check=False, timeout=60)
        if "nginx" in name:
            sh("podman", "exec", name, "sh", "-c", "tail -n 40 /var/log/nginx/*.log", check=False, timeout=30)


def remove_everything(run: Run | None, images: list[str]) -> None:
    """Containers, volumes and the network of the project, and ``images``."""
    if run is not None and run.compose_file.exists():
        compose(run, "down", "-v", check=False, quiet=True, timeout=300)
    for name in project_containers():
        sh("podman", "rm", "-f", "-v", name, check=False, quiet=True)
    vols = sh("podman", "volume", "ls", "--format", "{{.Name}}", check=False, quiet=True).stdout.split()
    for vol in vols:
        if vol.startswith(f"{PROJECT}_"):
            sh("podman", "volume", "rm", "-f", vol, check=False, quiet=True)
    for net in sh("podman", "network", "ls", "--format", "{{.Name}}", check=False, quiet=True).stdout.split():
        if net.startswith(f"{PROJECT}_"):
            sh("podman", "network", "rm", "-f", net, check=False, quiet=True)
    for image in images:
        if image_exists(image):
            sh("podman", "rmi", "-f", image, check=False, quiet=True)


def built_images() -> dict[str, str]:
    """service -> image name (podman's localhost/ form) of every service built."""
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return {s: "localhost/" + doc["services"][s]["image"] for s in BUILDS}


def checks(run: Run, images: dict[str, str]) -> None:
    if not (run.reuse and image_exists(PYTHON_BASE)):
        with step(run, "base images (debootstrap bookworm minbase, python3)"):
            make_base_images(run)
    run.compose_file.write_text(yaml.safe_dump(derived_compose(run), sort_keys=False))
    print(f"derived compose file {run.compose_file}:\n{run.compose_file.read_text()}")
    build_images(run, images)
    with step(run, "gateway image has no torch"):
        check_gateway_has_no_torch(images["gateway"])
    with step(run, "compose up"):
        compose(run, "up", "-d", *SERVICES, timeout=300)
    with step(run, "healthchecks pass"):
        wait_healthy(run, READY_TIMEOUT_S)
    with step(run, "API key through the keys service"):
        key = create_key(run)
    with step(run, "REST (openai) and gRPC through nginx"):
        check_edge(run, key)
    with step(run, "two models behind one gateway"):
        check_two_models(run, key)
    with step(run, "Prometheus targets up"):
        wait_for("Prometheus targets up", lambda: prometheus_targets_up(run), 90, every_s=5.0)
    with step(run, "worker SIGKILL mid-stream"):
        check_worker_kill(run, key)
    with step(run, "compose down"):
        compose(run, "down", "-v", timeout=300)
        left = project_containers()
        if left:
            raise CheckFailed(f"containers left after down: {left}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the images (and the work directory)")
    parser.add_argument("--reuse", action="store_true",
                        help="(iterating by hand) use images a --keep run left instead of building them")
    args = parser.parse_args()
    os.environ["BUILDAH_LAYERS"] = "false"  # one commit per image, no cached intermediate images left
    os.environ["BUILDAH_FORMAT"] = "docker"  # as Docker builds: HEALTHCHECK kept (OCI has no field for it)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("compose check: SIGTERM"))
    images = built_images()
    all_images = [*images.values(), PYTHON_BASE, DEBIAN_BASE]
    remove_everything(None, [] if args.reuse else all_images)  # leftovers of an interrupted run
    run = Run(Path(tempfile.mkdtemp(prefix="inflight-compose-ci-", dir="/var/tmp")), args.keep, args.reuse)
    start = time.monotonic()
    failed = None
    try:
        checks(run, images)
    except (CheckFailed, Exception) as exc:  # any failure: logs first, then clean up
        failed = exc
        print(f"\ncompose check FAILED: {exc}", flush=True)
        print_logs()
    finally:
        remove_everything(run, [] if args.keep else all_images)
        if not args.keep:
            shutil.rmtree(run.work, ignore_errors=True)
    print("\ncompose check timings:")
    for name, seconds in run.timings:
        print(f"  {seconds:6.0f} s  {name}")
    print(f"  {time.monotonic() - start:6.0f} s  total (podman part)")
    for service, size in run.sizes.items():
        print(f"  image {service}: {size / 1e6:.0f} MB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
