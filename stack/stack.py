"""The whole stack on one machine: Redis (embedded unless a URL is given: a private
redis-server with the ACL users of common/redis_acl.py, see stack/embedded_redis.py), one
worker (more with ``extra_workers``), one gateway (more with ``extra_gateways``) and, when
installed, the nginx edge.

Each service runs as its own process (``inflight worker`` / ``inflight gateway``)
so the worker's engine never shares a GIL with the gateway; logs go to
``run_dir/*.log``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from common.credentials import write_secret_file
from common.worker_options import WorkerOptions
from stack.embedded_redis import EmbeddedRedis, start_embedded_redis
from stack.edge import EdgeSettings, nginx_binary, self_signed_pair, start_nginx
from stack.startup import LogFollower, StartupSteps


@dataclass(frozen=True)
class StackSettings:
    """Ports, paths and options of a one-machine stack (ports are TCP ports on 127.0.0.1)."""

    run_dir: Path
    redis_url: str | None = None
    model: str | None = None
    use_nginx: bool = True
    rest_port: int = 8000
    grpc_port: int = 50051
    link_port: int = 50052
    worker_health_port: int = 9100
    worker_grpc_health_port: int = 9101
    edge_rest_port: int = 8080
    edge_grpc_port: int = 8081
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    edge_overrides: dict = field(default_factory=dict)
    ready_timeout_s: float = 300.0
    log_format: str = "text"
    tls: bool = False  # the edge speaks TLS with a self-signed pair made in run_dir/tls
    #: More workers on this machine, one (health port, gRPC health port) each: ``worker-2``,
    #: ``worker-3``, ... (the KV-routing benchmark's fleet); not restarted by :meth:`supervise`.
    extra_workers: tuple[tuple[int, int], ...] = ()
    #: More gateways on this machine, one (REST port, gRPC port, link port) each: ``gateway-2``,
    #: ``gateway-3``, ...; nginx balances over all of them (the chaos soak's fleet).
    extra_gateways: tuple[tuple[int, int, int], ...] = ()

    def with_port_offset(self, offset: int) -> "StackSettings":
        """A copy with every ``*_port`` moved by ``offset``, for a second stack on
        the same machine (``inflight up --port-offset 100``: edge 8180, gateway 8100, ...).

        Raises:
            ValueError: a port would leave 1..65535.
        """
        ports = {f.name: getattr(self, f.name) + offset for f in fields(self) if f.name.endswith("_port")}
        bad = {name: port for name, port in ports.items() if not 0 < port < 65536}
        if bad:
            raise ValueError(f"--port-offset {offset} puts ports outside 1..65535: {bad}")
        return replace(self, **ports)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now (bound as servers bind, with
    ``SO_REUSEADDR``, so a port left in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class Stack:
    """Starts and stops the services of :class:`StackSettings`; use as a context manager.

    Raises:
        RuntimeError: from :meth:`start` when a service exits or is not ready in time
            (the tail of its log is included).
    """

    def __init__(self, settings: StackSettings, steps: StartupSteps | None = None):
        self.settings = settings
        self.steps = steps or StartupSteps()  # what start() reports (inflight up prints it)
        self.redis_url = settings.redis_url  # embedded: the admin user's (what `inflight keys` takes)
        self._redis: EmbeddedRedis | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self._restarted_at: dict[str, float] = {}  # monotonic s of the last supervised restart

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start Redis, worker, gateway and nginx, and wait until the gateway is ready.
        On any failure (or Ctrl-C) whatever was started is stopped again."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def supervise(self, min_interval_s: float = 5.0) -> list[str]:
        """Start again a worker or gateway that exited on its own (a crash, an OOM kill),
        as a process supervisor would (the extra workers and gateways too); call it
        periodically. A service is restarted at
        most once per ``min_interval_s`` seconds, so a crash loop does not spin.

        Returns:
            The names of the services restarted by this call.
        """
        restarted = []
        now = time.monotonic()
        for name, args in self._service_args().items():
            proc = self._procs.get(name)
            if proc is None or proc.poll() is None or now - self._restarted_at.get(name, 0.0) < min_interval_s:
                continue
            with open(self.settings.run_dir / f"{name}.log", "ab") as log:
                log.write(f"--- exited with {proc.returncode}; restarted by inflight up ---\n".encode())
            self._spawn(name, args)
            self._restarted_at[name] = now
            restarted.append(name)
        return restarted

    @property
    def redis_password_file(self) -> Path | None:
        """The password file of :attr:`redis_url`'s user (admin) for the embedded Redis;
        None for a Redis given by URL."""
        return self._redis.password_file("admin") if self._redis is not None else None

    @property
    def link_secret_file(self) -> Path:
        """The link secret this stack's worker and gateway share (random, mode 0600)."""
        return self.settings.run_dir / "link.secret"

    def listen_ports(self) -> dict[int, str]:
        """Every TCP port on 127.0.0.1 this stack's services will listen on, with who listens."""
        s = self.settings
        ports = {s.rest_port: "gateway REST", s.grpc_port: "gateway gRPC", s.link_port: "gateway link",
                 s.worker_health_port: "worker health", s.worker_grpc_health_port: "worker gRPC health"}
        if s.use_nginx and nginx_binary() is not None:
            ports.update({s.edge_rest_port: "edge REST", s.edge_grpc_port: "edge gRPC"})
        for i, (health, grpc_health) in enumerate(s.extra_workers, start=2):
            ports.update({health: f"worker-{i} health", grpc_health: f"worker-{i} gRPC health"})
        for i, (rest, grpc_port, link) in enumerate(s.extra_gateways, start=2):
            ports.update({rest: f"gateway-{i} REST", grpc_port: f"gateway-{i} gRPC", link: f"gateway-{i} link"})
        return {port: who for port, who in ports.items() if port}

    def _check_ports_free(self) -> None:
        """Refuse to start over ports another process (most often another stack) listens on:
        otherwise this stack's readiness checks were answered by that one, ``inflight up``
        printed "ready" and an API key its own Redis holds but nothing that listens reads, and
        its worker and gateway failed to bind and were restarted over and over.

        Raises:
            RuntimeError: one line naming the ports in use.
        """
        busy = [f"{port} ({who})" for port, who in sorted(self.listen_ports().items()) if not port_free(port)]
        if busy:
            raise RuntimeError(f"already in use on 127.0.0.1: {', '.join(busy)}; is another stack running? "
                               "Stop it, or move this one with --port-offset 100")

    def _start(self) -> None:
        self._check_ports_free()
        self.settings.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.link_secret_file.exists():
            write_secret_file(self.link_secret_file)
        if self.redis_url is None:
            with self.steps.step("redis"):
                self._redis = self._start_embedded_redis()
                self.redis_url = self._redis.url("admin")
        follow = LogFollower(self.settings.run_dir / "worker.log")
        self._spawn("worker", self._worker_args())
        for i, ports in enumerate(self.settings.extra_workers, start=2):
            self._spawn(f"worker-{i}", self._worker_args(ports, f"worker-{i}"))
        self._spawn("gateway", self._gateway_args())
        for i, ports in enumerate(self.settings.extra_gateways, start=2):
            self._spawn(f"gateway-{i}", self._gateway_args(ports))
        if self.settings.worker_health_port:
            with self.steps.step("worker (CPU kernels, model load, warm-up)"):
                self._wait_url(f"http://127.0.0.1:{self.settings.worker_health_port}/ready", self._procs, follow)
        with self.steps.step("gateway"):
            self._wait_ready()
        for i, (health_port, _) in enumerate(self.settings.extra_workers, start=2):
            self._wait_url(f"http://127.0.0.1:{health_port}/ready", {f"worker-{i}": self._procs[f"worker-{i}"]})
        for i, (rest_port, _, _) in enumerate(self.settings.extra_gateways, start=2):
            self._wait_url(f"http://127.0.0.1:{rest_port}/ready", {f"gateway-{i}": self._procs[f"gateway-{i}"]})
        if self.settings.use_nginx and nginx_binary() is not None:
            with self.steps.step("nginx edge" + (" (TLS)" if self.settings.tls else "")):
                if self.settings.tls and not (self.settings.run_dir / "tls" / "edge.crt").exists():
                    self_signed_pair(self.settings.run_dir / "tls")
                self._procs["nginx"] = start_nginx(self.edge_settings())

    def stop(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL after 15 s), nginx first."""
        extra = [f"worker-{i}" for i in range(2, len(self.settings.extra_workers) + 2)]
        extra += [f"gateway-{i}" for i in range(2, len(self.settings.extra_gateways) + 2)]
        for name in ("nginx", "gateway", "worker", *extra):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._redis is not None:
            self._redis.stop()  # also removes its socket directory when it had died
            self._redis, self.redis_url = None, self.settings.redis_url

    def restart_worker(self, sig: int = signal.SIGTERM, exit_timeout_s: float = 300.0) -> dict:
        """Stop the worker with ``sig`` (SIGTERM: drain, running requests finish or are handed
        back; SIGKILL: a crash), wait for it to exit, start a new one on the same ports and
        wait until its ``/ready`` answers 200.

        Returns:
            ``{"exit_s": seconds from the signal to the exit, "ready_s": seconds from the
            signal until the new worker is ready, "exit_code": the old process's exit status}``.

        Raises:
            RuntimeError: no worker runs, or the new one exits or is not ready within
                ``ready_timeout_s`` (the tail of its log is included).
            subprocess.TimeoutExpired: the old worker did not exit within ``exit_timeout_s``.
        """
        proc = self._procs.get("worker")
        if proc is None or proc.poll() is not None:
            raise RuntimeError("no running worker to restart")
        started = time.monotonic()
        os.killpg(proc.pid, sig)  # its own session (see _spawn): nothing else gets the signal
        code = proc.wait(exit_timeout_s)
        exit_s = time.monotonic() - started
        self._spawn("worker", self._worker_args())
        url = f"http://127.0.0.1:{self.settings.worker_health_port}/ready"
        self._wait_url(url, {"worker": self._procs["worker"]})
        return {"exit_s": exit_s, "ready_s": time.monotonic() - started, "exit_code": code}

    # -------------------------------------------------------------- queries
    @property
    def has_edge(self) -> bool:
        """True when nginx runs in front of the gateway."""
        return "nginx" in self._procs

    def edge_settings(self) -> EdgeSettings:
        """The nginx settings for this stack."""
        s = self.settings
        tls = ({"tls_cert": str(s.run_dir / "tls" / "edge.crt"), "tls_key": str(s.run_dir / "tls" / "edge.key")}
               if s.tls else {})
        return EdgeSettings(run_dir=str(s.run_dir / "nginx"), rest_port_edge=s.edge_rest_port,
                            grpc_port_edge=s.edge_grpc_port, rest_port=s.rest_port,
                            grpc_port=s.grpc_port, extra_rest_ports=tuple(g[0] for g in s.extra_gateways),
                            extra_grpc_ports=tuple(g[1] for g in s.extra_gateways),
                            **{**tls, **s.edge_overrides})

    def endpoints(self) -> dict[str, str]:
        """Client-facing addresses: through nginx when it runs, else the gateway's own."""
        s = self.settings
        rest = s.edge_rest_port if self.has_edge else s.rest_port
        grpc_port = s.edge_grpc_port if self.has_edge else s.grpc_port
        tls = self.has_edge and s.tls
        extra = {"tls_ca": str(s.run_dir / "tls" / "edge.crt")} if tls else {}
        return {"rest": f"{'https://localhost' if tls else 'http://127.0.0.1'}:{rest}",
                "grpc": f"{'localhost' if tls else '127.0.0.1'}:{grpc_port}", **extra,
                "gateway_rest": f"http://127.0.0.1:{s.rest_port}",
                "worker_metrics": f"http://127.0.0.1:{s.worker_health_port}/metrics",
                "worker_grpc_health": f"127.0.0.1:{s.worker_grpc_health_port}",
                "redis": self.redis_url or "",
                **({"redis_password_file": str(self.redis_password_file)} if self.redis_password_file else {})}

    def create_key(self, tenant: str = "demo", name: str = "inflight up", admin: bool = False) -> str:
        """Create an API key in this stack's Redis and return its plaintext (``admin``: it may
        also read the fleet view)."""
        out = self._cli(["keys", "create", *self._redis_args("admin"), "--tenant", tenant,
                         "--name", name, "--quiet", *(["--admin"] if admin else [])])
        return out.strip().splitlines()[-1]

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last ``lines`` lines of a service's log, after its first lines when they
        would be cut (a bind error comes first, its consequences last)."""
        path = self.settings.run_dir / f"{name}.log"
        if not path.exists():
            return ""
        text = path.read_text(errors="replace").splitlines()
        if len(text) <= lines + 5:
            return "\n".join(text)
        return "\n".join([*text[:5], f"… ({len(text) - lines - 5} lines) …", *text[-lines:]])

    def pid(self, name: str) -> int | None:
        """Process id of a running service ("worker", "gateway", "nginx", "worker-2", "gateway-2", ...)."""
        proc = self._procs.get(name)
        return proc.pid if proc is not None else None

    # ------------------------------------------------------------- helpers
    def _worker_args(self, ports: tuple[int, int] | None = None, worker_id: str | None = None) -> list[str]:
        health, grpc_health = ports or (self.settings.worker_health_port, self.settings.worker_grpc_health_port)
        own = WorkerOptions(health_port=health, grpc_health_port=grpc_health,
                            link_secret_file=str(self.link_secret_file), worker_id=worker_id)
        return ["worker", *self._redis_args("worker"),
                *own.to_argv(("health_port", "grpc_health_port", "link_secret_file", "worker_id")),
                *self._model_args(), *self.settings.worker_args]

    def _service_args(self) -> dict[str, list[str]]:
        """The command line of every worker and gateway, by service name."""
        args = {"worker": self._worker_args(), "gateway": self._gateway_args()}
        for i, ports in enumerate(self.settings.extra_workers, start=2):
            args[f"worker-{i}"] = self._worker_args(ports, f"worker-{i}")
        for i, ports in enumerate(self.settings.extra_gateways, start=2):
            args[f"gateway-{i}"] = self._gateway_args(ports)
        return args

    def _gateway_args(self, ports: tuple[int, int, int] | None = None) -> list[str]:
        rest, grpc_port, link = ports or (self.settings.rest_port, self.settings.grpc_port, self.settings.link_port)
        return ["gateway", *self._redis_args("gateway"), "--rest-port", str(rest),
                "--grpc-port", str(grpc_port), "--link-port", str(link),
                "--link-secret-file", str(self.link_secret_file),
                *self._model_args(), *self.settings.gateway_args]

    def _model_args(self) -> list[str]:
        return ["--model", self.settings.model] if self.settings.model else []

    def _redis_args(self, role: str) -> list[str]:
        """``--redis-url`` (and, for the embedded Redis, ``role``'s user and password file)."""
        if self._redis is None:
            return ["--redis-url", self.redis_url]
        return ["--redis-url", self._redis.url(role), "--redis-password-file", str(self._redis.password_file(role))]

    def _start_embedded_redis(self) -> EmbeddedRedis:
        """A private redis-server with the ACL users, new passwords in ``run_dir/redis-passwords``."""
        return start_embedded_redis(self.settings.run_dir / "redis-passwords", self.settings.run_dir / "redis.log")

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.settings.run_dir / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cli = [sys.executable, "-m", "inflight.cli", "--log-format", self.settings.log_format]
        self._procs[name] = subprocess.Popen([*cli, *args],
                                             stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)

    def _cli(self, args: list[str]) -> str:
        proc = subprocess.run([sys.executable, "-m", "inflight.cli", *args],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"inflight {' '.join(args[:2])} failed: {proc.stderr.strip()}")
        return proc.stdout

    def _wait_ready(self) -> None:
        self._wait_url(f"http://127.0.0.1:{self.settings.rest_port}/ready", self._procs)

    def _wait_url(self, url: str, procs: dict[str, subprocess.Popen], follow: LogFollower | None = None) -> None:
        """Wait until ``url`` answers 200 while every process of ``procs`` runs; the progress
        lines ``follow`` finds in a log meanwhile go to :attr:`steps`."""
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while time.monotonic() < deadline:
            for message in follow.new_progress() if follow is not None else ():
                self.steps.say(message)
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{url} not ready after {self.settings.ready_timeout_s} s:\n"
                           f"{self.log_tail('worker')}\n{self.log_tail('gateway')}")
