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
and ``X-Real-IP``/``X-Forwarded-For`` towards the gateway. ``server_tokens off`` and
security headers (``X-Content-Type-Options``, ``X-Frame-Options`` and CSP
``frame-ancestors``, ``Referrer-Policy``; HSTS only with TLS) on REST answers. With
``tls_cert`` and ``tls_key`` both listeners speak TLS (gRPC over HTTP/2 with ALPN ``h2``);
:func:`self_signed_pair` makes a local pair (``inflight up --tls``).
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
    #: nginx ``send_timeout`` on the API: a client that takes no byte of its response for this
    #: long is closed, and its gateway then cancels the request (KV freed). The gateway's
    #: ``--stream-idle-timeout`` (30 s) cannot see such a client behind nginx when the stream
    #: fits the loopback socket buffers between them, which autotune to megabytes (the chaos
    #: soak's 30-minute run): the same default, enforced where the client is.
    client_send_timeout_s: int = 30
    tls_cert: str = ""
    tls_key: str = ""
    #: More gateways' REST and gRPC ports on ``gateway_host``, balanced with the first (round
    #: robin; a gateway that refuses the connection is skipped for the next one).
    extra_rest_ports: tuple[int, ...] = ()
    extra_grpc_ports: tuple[int, ...] = ()

    @property
    def tls(self) -> bool:
        """Both listeners speak TLS (a certificate and its key are set)."""
        return bool(self.tls_cert and self.tls_key)


_SECURITY_HEADERS = (
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Content-Security-Policy", "\"frame-ancestors 'none'\""),
    ("Referrer-Policy", "no-referrer"),
)
_HSTS = ("Strict-Transport-Security", "\"max-age=31536000\"")


def template_values(settings: EdgeSettings, user_directive: str) -> dict[str, str]:
    """Every placeholder of ``nginx/nginx.conf.template`` for ``settings``."""
    values = {k: str(v) for k, v in asdict(settings).items()}
    values["user_directive"] = user_directive
    for kind, ports in (("rest", settings.extra_rest_ports), ("grpc", settings.extra_grpc_ports)):
        values[f"extra_{kind}_servers"] = "".join(f"\n        server {settings.gateway_host}:{p};" for p in ports)
    headers = [*_SECURITY_HEADERS, *([_HSTS] if settings.tls else [])]
    values["security_headers"] = "\n".join(f"        add_header {name} {value} always;" for name, value in headers)
    values["rest_listen_tls"] = values["grpc_listen_tls"] = " ssl" if settings.tls else ""
    values["tls_directives"] = (
        f"        ssl_certificate {settings.tls_cert};\n"
        f"        ssl_certificate_key {settings.tls_key};\n"
        "        ssl_protocols TLSv1.2 TLSv1.3;\n"
        "        ssl_prefer_server_ciphers off;\n"
        "        ssl_session_cache shared:tls:10m;\n"
        "        ssl_session_tickets off;") if settings.tls else ""
    return values


def self_signed_pair(directory: str | os.PathLike, host: str = "localhost") -> tuple[str, str]:
    """A self-signed certificate for ``host``, 127.0.0.1 and ::1 (30 days, RSA 2048) made with the
    ``openssl`` command, written to ``directory/edge.crt`` and ``edge.key`` (0600); returns
    their paths. The certificate is its own CA: clients pass it as the trusted root.

    Raises:
        RuntimeError: ``openssl`` is missing or fails.
    """
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError("openssl is not installed (needed for a self-signed edge certificate)")
    cert, key = Path(directory) / "edge.crt", Path(directory) / "edge.key"
    Path(directory).mkdir(parents=True, exist_ok=True)
    os.close(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    proc = subprocess.run([binary, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-sha256", "-days", "30",
                           "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={host}",
                           "-addext", f"subjectAltName=DNS:{host},IP:127.0.0.1,IP:::1",
                           "-addext", "basicConstraints=critical,CA:TRUE"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl failed: {proc.stderr.strip()}")
    os.chmod(key, 0o600)
    return str(cert), str(key)


def nginx_binary() -> str | None:
    """Path of the nginx executable, or None when nginx is not installed."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None
    )


def render_config(settings: EdgeSettings) -> str:
    """The nginx.conf text for ``settings`` (raises KeyError on a template placeholder left unset)."""
    # Workers of a root master drop to "nobody", who cannot write our temp dirs.
    values = template_values(settings, "user root;" if os.geteuid() == 0 else "")
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
