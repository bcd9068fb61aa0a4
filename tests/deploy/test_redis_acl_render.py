"""deploy/redis/render-acl.sh: the Redis ACL rendered at container start from the password
files, as compose.yaml and deploy/k8s/redis.yaml run it.

* its output is exactly ``common.redis_acl.render_acl`` (the one source of the ACL) for
  the same password files, plus the KEDA user in Kubernetes;
* a password file that is empty, holds spaces or non-ASCII text, or is missing stops the
  start with an error that names the file and never shows its content;
* a real redis-server >= 7 started with the very command line of each manifest (paths
  moved into a temporary folder) lets each user in with its own password only, the KEDA
  user read the queue's lag and nothing else, and no password is on any command line;
* the ConfigMap copy (deploy/k8s/redis-acl.yaml) is fresh.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from common.redis_acl import ROLES, render_acl
from tests.helpers.redis_server import free_port, redis_server_binary

ROOT = Path(__file__).resolve().parents[2]
REDIS_DIR = ROOT / "deploy" / "redis"
SCRIPT = REDIS_DIR / "render-acl.sh"
PASSWORDS = {role: f"{role}-Pw_0123456789abcdef" for role in (*ROLES, "keda")}

pytestmark = pytest.mark.skipif(not (shutil.which("sh") and shutil.which("sha256sum")),
                                reason="needs sh and sha256sum (as in the redis:7-alpine image)")


def _write_passwords(folder: Path, pattern: str = "{}", decorate: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for role, password in PASSWORDS.items():
        # Surrounding whitespace and a CRLF ending are stripped, as common/credentials.py does.
        (folder / pattern.format(role)).write_text(f"  {password}\r\n\n" if decorate else password)


def _render(pattern: str, out: Path, *templates: Path, command: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    args = ["sh", str(SCRIPT), pattern, str(out), *map(str, templates), *(("--", *command) if command else ())]
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def test_the_script_renders_what_common_redis_acl_renders(tmp_path):
    _write_passwords(tmp_path / "pw")
    out = tmp_path / "users.acl"
    proc = _render(str(tmp_path / "pw" / "%s"), out, REDIS_DIR / "users.acl")
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == render_acl({r: PASSWORDS[r] for r in ROLES})
    assert out.stat().st_mode & 0o777 == 0o600


def test_kubernetes_adds_the_read_only_keda_user(tmp_path):
    _write_passwords(tmp_path, "redis_{}_password")
    out = tmp_path / "users.acl"
    proc = _render(str(tmp_path / "redis_%s_password"), out, REDIS_DIR / "users.acl", REDIS_DIR / "keda.acl",
                   command=("echo", "started"))
    assert proc.returncode == 0 and proc.stdout == "started\n", proc.stderr  # then runs the command
    lines = out.read_text().splitlines()
    assert lines[:-1] == render_acl({r: PASSWORDS[r] for r in ROLES}).splitlines()
    digest = hashlib.sha256(PASSWORDS["keda"].encode()).hexdigest()
    assert lines[-1].startswith(f"user keda on #{digest} ")
    assert not re.search(r"@[A-Z_]+_SHA256@", out.read_text())  # no placeholder left


@pytest.mark.parametrize("content,message", [
    ("", "is empty"), ("\n  \n", "is empty"), ("two words", "printable ASCII without spaces"),
    ("pässwort-geheim", "printable ASCII without spaces"), (None, "cannot read"),
])
def test_a_bad_password_file_stops_the_start_and_is_never_shown(tmp_path, content, message):
    _write_passwords(tmp_path)
    if content is None:
        (tmp_path / "worker").unlink()
    else:
        (tmp_path / "worker").write_text(content)
    out = tmp_path / "users.acl"
    proc = _render(str(tmp_path / "%s"), out, REDIS_DIR / "users.acl", command=("echo", "started"))
    assert proc.returncode != 0 and "started" not in proc.stdout
    assert message in proc.stderr and str(tmp_path / "worker") in proc.stderr, proc.stderr
    if content and content.strip():
        assert content.split()[0] not in proc.stderr
    assert not out.exists() and list(tmp_path.glob("users.acl*")) == []  # nothing half-written


def test_the_k8s_configmap_carries_the_script_and_templates_unchanged():
    sys.path.insert(0, str(ROOT / "deploy"))
    import render_k8s_redis_acl

    assert render_k8s_redis_acl.OUTPUT.read_text() == render_k8s_redis_acl.render(), \
        "run python deploy/render_k8s_redis_acl.py"
    doc = yaml.safe_load(render_k8s_redis_acl.OUTPUT.read_text())
    assert doc["data"] == {p.name: p.read_text() for p in render_k8s_redis_acl.FILES}
    kustomization = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())
    assert render_k8s_redis_acl.OUTPUT.name in kustomization["resources"]


# ------------------------------------------------------------------ a real Redis


def _redis_major() -> int:
    try:
        out = subprocess.run([redis_server_binary(), "--version"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return 0
    found = re.search(r"v=(\d+)\.", out)
    return int(found.group(1)) if found else 0


def _k8s_command() -> tuple[list[str], dict[str, str]]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "redis.yaml").read_text())
    c = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    return [*c["command"], *c["args"]], {"acl": mounts["acl"], "passwords": mounts["passwords"], "tmp": "/tmp"}


def _compose_command() -> tuple[list[str], dict[str, str]]:
    service = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    acl = next(v for v in service["volumes"] if v.startswith("./deploy/redis:")).split(":")[1]
    return [*service["entrypoint"], *service["command"]], {"acl": acl, "passwords": "/run/secrets", "tmp": "/tmp"}


def _moved(words: list[str], where: dict[str, str], tmp: Path) -> list[str]:
    """The manifest's command line with its container paths moved under ``tmp``."""
    moves = ((where["acl"] + "/", f"{REDIS_DIR}/"), (where["passwords"] + "/", f"{tmp / 'secrets'}/"),
             (where["tmp"] + "/", f"{tmp / 'run'}/"))
    out = []
    for word in words:
        for old, new in moves:
            if word.startswith(old):
                word = new + word[len(old):]
                break
        out.append(redis_server_binary() if word == "redis-server" else word)
    return out


@pytest.fixture(params=["k8s", "compose"])
def started(request, tmp_path):
    """redis-server started by render-acl.sh as the manifest starts it; yields (port, users)."""
    if _redis_major() < 7:
        pytest.skip("ACL selectors need redis-server >= 7")
    words, where = _k8s_command() if request.param == "k8s" else _compose_command()
    pattern = next(w for w in words if "%s" in w)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "run").mkdir()
    for role, password in PASSWORDS.items():
        path = Path(_moved([pattern], where, tmp_path)[0] % role)
        path.write_text(password + "\n")
    port = free_port()
    cmd = [*_moved(words, where, tmp_path), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path / "run"),
           "--save", ""]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis did not start: {proc.stderr.read() if proc.poll() is not None else ''}")
                time.sleep(0.05)
        client.close()
        users = {"k8s": {*ROLES, "keda"}, "compose": set(ROLES)}[request.param]
        yield proc, port, users
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _login(port: int, user: str, password: str) -> redis.Redis:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries: a refused password is the answer, not a hiccup to back off from.
    return redis.Redis(host="127.0.0.1", port=port, username=user, password=password,
                       retry=Retry(NoBackoff(), 0))


def test_each_user_logs_in_with_its_own_password_only(started):
    proc, port, users = started
    for user in users:
        assert _login(port, user, PASSWORDS[user]).ping()
        other = next(u for u in users if u != user)
        with pytest.raises(redis.AuthenticationError):
            _login(port, user, PASSWORDS[other]).ping()
    default = redis.Redis(port=port)
    assert default.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        default.get("inflight:keys:id:k1")
    if "keda" not in users:  # compose has no KEDA
        with pytest.raises(redis.AuthenticationError):
            _login(port, "keda", PASSWORDS["keda"]).ping()
    # The secrets are files: no password on the command line that started it, nor on the
    # server's (redis-server rewrites its process title).
    assert not any(p in " ".join(proc.args) for p in PASSWORDS.values())
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    if cmdline.exists():
        assert not any(p in cmdline.read_bytes().decode(errors="replace") for p in PASSWORDS.values())


def test_the_keda_user_reads_the_lag_and_nothing_else(started):
    _, port, users = started
    if "keda" not in users:
        pytest.skip("compose has no KEDA")
    worker = _login(port, "worker", PASSWORDS["worker"])
    worker.xgroup_create("inflight:requests:1", "inflight-workers", id="0", mkstream=True)
    keda = _login(port, "keda", PASSWORDS["keda"])
    assert keda.xinfo_groups("inflight:requests:1")[0]["name"] == b"inflight-workers"
    assert keda.xlen("inflight:requests:1") == 0
    assert keda.xpending("inflight:requests:1", "inflight-workers")["pending"] == 0
    for denied in (("XADD", "inflight:requests:1", "*", "req", "x"),
                   ("XREADGROUP", "GROUP", "inflight-workers", "c", "STREAMS", "inflight:requests:1", ">"),
                   ("XACK", "inflight:requests:1", "inflight-workers", "1-1"),
                   ("HGETALL", "inflight:keys:hash:abc"), ("GET", "inflight:keys:id:k1"),
                   ("ZCARD", "inflight:rl:{k1}:req"), ("XLEN", "inflight:dead:1"),
                   ("KEYS", "*"), ("FLUSHALL",), ("CONFIG", "GET", "*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            keda.execute_command(*denied)


def test_the_script_is_plain_posix_sh():
    """busybox sh runs it in the image; dash (Debian's sh) is as strict, bash-isms fail there."""
    text = SCRIPT.read_text()
    assert text.startswith("#!/bin/sh\n") and "[[" not in text and "local " not in text
    assert os.access(SCRIPT, os.R_OK)
