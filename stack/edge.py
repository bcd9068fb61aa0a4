"""Render the nginx edge config from ``nginx/nginx.conf.template`` and run nginx.

Used by ``inflight up`` and by the tests, which run real nginx (installed by
``.ci/run`` with apt-get). The template carries the source article's settings
as defaults: per-IP ``rate=10r/s`` with ``burst=20 nodelay``.

What the edge does (DESIGN "Request lifecycle" step 1): per-IP and per-key
``limit_req`` (the key is the Authorization header, the client address when the
header is empty or has no token), a per-key connection cap, a body-size cap
(413), rejections as OpenAI-style JSON with ``Retry-After`` on REST and as a real
``grpc-status`` on gRPC (RESOURCE_EXHAUSTED for limits and oversize bodies,
UNAVAILABLE when the gateway is down), unbuffered SSE with long read timeouts,
and ``X-Real-IP``/``X-Forwarded-For`` towards the gateway.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from string import Template

TEMPLATE = Path(__file__).resolve().parent.parent / "nginx" / "nginx.conf.template"


@dataclass(frozen=True)
class EdgeSettings:
    """Ports and limits of the edge. Rates are requests per second; sizes use
    nginx syntax ("1m"); timeouts are seconds."""

    run_dir: str
    rest_port_edge: int = 8080
    grpc_port_edge: int = 8081
    listen_host: str = "127.0.0.1"
    gateway_host: str = "127.0.0.1"
    rest_port: int = 8000
    grpc_port: int = 50051
    ip_rate: int = 10
    ip_burst: int = 20
    key_rate: int = 10
    key_burst: int = 20
    key_conns: int = 64
    max_body: str = "1m"
    read_timeout_s: int = 600


def nginx_binary() -> str | None:
    """Path of the nginx executable, or None when nginx is not installed."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None
    )


def render_config(settings: EdgeSettings) -> str:
    """The nginx.conf text for ``settings`` (raises KeyError on a template placeholder left unset)."""
    values = {k: str(v) for k, v in asdict(settings).items()}
    # Workers of a root master drop to "nobody", who cannot write our temp dirs.
    values["user_directive"] = "user root;" if os.geteuid() == 0 else ""
    return Template(TEMPLATE.read_text()).substitute(values)


def write_config(settings: EdgeSettings) -> Path:
    """Write nginx.conf and nginx's temp folders under ``settings.run_dir``; returns the config path."""
    run_dir = Path(settings.run_dir)
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    conf = run_dir / "nginx.conf"
    conf.write_text(render_config(settings))
    return conf


def check_config(settings: EdgeSettings) -> None:
    """Run ``nginx -t`` on the rendered config.

    Raises:
        RuntimeError: nginx is missing or rejects the config (its message included).
    """
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed")
    conf = write_config(settings)
    proc = subprocess.run([binary, "-t", "-p", settings.run_dir, "-c", str(conf), "-e", "stderr"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nginx -t failed: {proc.stderr.strip()}")


def start_nginx(settings: EdgeSettings, timeout_s: float = 10.0) -> subprocess.Popen:
    """Start nginx in the foreground (``daemon off``) as a child process and wait
    until both listeners accept connections.

    Raises:
        RuntimeError: nginx is missing, rejects the config, or does not listen within ``timeout_s``.
    """
    check_config(settings)
    conf = Path(settings.run_dir) / "nginx.conf"
    proc = subprocess.Popen([nginx_binary(), "-p", settings.run_dir, "-c", str(conf), "-e", "stderr"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    ports = (settings.rest_port_edge, settings.grpc_port_edge)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited: {proc.stderr.read().decode(errors='replace')}")
        if all(_listening(settings.listen_host, p) for p in ports):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"nginx did not listen on {ports} within {timeout_s} s")


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0
