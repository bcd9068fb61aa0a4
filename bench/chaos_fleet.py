"""The chaos soak's fleet on this machine (``bench/chaos.py``): Redis primary + replica + three
sentinels (:mod:`stack.redis_sentinel`), two workers, two gateways and nginx balancing over
both gateways (:class:`stack.stack.Stack` with ``extra_workers`` and ``extra_gateways``), every
service reached through the ``redis+sentinel://`` URL. A supervisor thread starts again a
worker or gateway that died (as ``inflight up`` does), so a SIGKILL is followed by a restart.

Also what the soak reads from it: each service's pid, ``/ready``, metrics, and the RSS of every
process (nginx with its worker processes).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.targets.stack import OPEN_EDGE, free_ports
from common.worker_options import WorkerOptions

MIB = 2 ** 20
WORKERS = ("worker", "worker-2")
GATEWAYS = ("gateway", "gateway-2")


def http_status(url: str, timeout_s: float = 1.0) -> int:
    """The status of ``GET url`` (0 when it does not answer)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def rss_mib(pid: int | None, children: bool = False) -> float:
    """Resident memory of ``pid`` (and its children), MiB; 0 when it does not run."""
    if not pid:
        return 0.0
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)] if children else [proc]
        return sum(p.memory_info().rss for p in procs) / MIB
    except psutil.Error:
        return 0.0


@dataclass
class Fleet:
    """A started fleet: ``stack`` (workers, gateways, nginx) and ``sentinels``."""

    stack: object
    sentinels: object
    worker_health: dict[str, int]
    gateway_rest: dict[str, int]
    supervised: list[tuple[float, str]] = field(default_factory=list)  # (monotonic s, name) restarts
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    # --------------------------------------------------------------- queries
    def pid(self, name: str) -> int | None:
        """Process id of a service: a worker, a gateway, ``nginx``, or a Redis/sentinel process
        (``redis-master``, ``redis-replica``, ``sentinel-0`` ...)."""
        if name.startswith("redis-"):
            return self.sentinels.pids().get(name[len("redis-"):])
        if name.startswith("sentinel-"):
            return self.sentinels.pids().get(name)
        return self.stack.pid(name)

    def names(self) -> list[str]:
        """Every process of the fleet, by name."""
        return [*WORKERS, *GATEWAYS, "nginx", "redis-master", "redis-replica", "sentinel-0", "sentinel-1",
                "sentinel-2"]

    def rss(self) -> dict[str, tuple[int | None, float]]:
        """(pid, RSS MiB) of every process (nginx: master and workers together)."""
        return {name: (self.pid(name), round(rss_mib(self.pid(name), children=name == "nginx"), 1))
                for name in self.names()}

    def worker_ready(self, name: str) -> bool:
        """The worker's ``/ready`` answers 200."""
        return http_status(f"http://127.0.0.1:{self.worker_health[name]}/ready") == 200

    def gateway_ready(self, name: str) -> bool:
        """The gateway's ``/ready`` answers 200."""
        return http_status(f"http://127.0.0.1:{self.gateway_rest[name]}/ready") == 200

    def metrics_urls(self) -> dict[str, str]:
        """``/metrics`` of every worker and gateway, by name."""
        urls = {n: f"http://127.0.0.1:{p}/metrics" for n, p in self.worker_health.items()}
        urls.update({n: f"http://127.0.0.1:{p}/metrics" for n, p in self.gateway_rest.items()})
        return urls

    def whole(self) -> bool:
        """Every worker and gateway ready, and the Redis master has an online replica."""
        try:
            replicated = self.sentinels.replicated()
        except Exception:  # noqa: BLE001 - failing over: not whole
            replicated = False
        return replicated and all(map(self.worker_ready, WORKERS)) and all(map(self.gateway_ready, GATEWAYS))

    # ------------------------------------------------------------ lifecycle
    def supervise_in_background(self, every_s: float = 0.5) -> None:
        """Start the supervisor thread (restarts a dead worker or gateway at once)."""
        def loop() -> None:
            while not self._stop.wait(every_s):
                for name in self.stack.supervise(min_interval_s=1.0):
                    self.supervised.append((time.monotonic(), name))
        self._thread = threading.Thread(target=loop, name="chaos-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the supervisor, every service, and the Redis set."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for name in WORKERS:  # a stopped worker would ignore SIGTERM until the 15 s kill
            pid = self.stack.pid(name)
            if pid:
                try:
                    os.killpg(pid, 18)  # SIGCONT
                except OSError:
                    pass
        try:
            self.stack.stop()
        finally:
            self.sentinels.stop()


def start_fleet(options: WorkerOptions, worker_args: tuple[str, ...], gateway_args: tuple[str, ...],
                down_after_ms: int = 1000, client_send_timeout_s: int = 30) -> Fleet:
    """Start the Redis set, then two workers, two gateways and nginx on free ports; wait until
    all are ready. ``client_send_timeout_s``: the edge's ``send_timeout`` (seconds), the
    gateways' ``--stream-idle-timeout`` enforced at nginx.

    Raises:
        RuntimeError: a service did not come up (its log's tail included).
    """
    from stack.redis_sentinel import start_sentinel_set
    from stack.stack import Stack, StackSettings

    sentinels = start_sentinel_set(down_after_ms=down_after_ms)
    ports = free_ports(12)
    run_dir = Path(tempfile.mkdtemp(prefix="inflight-chaos-"))
    settings = StackSettings(
        run_dir=run_dir, redis_url=sentinels.url(), model=options.model, edge_overrides={**OPEN_EDGE, "client_send_timeout_s": client_send_timeout_s},
        rest_port=ports[0], grpc_port=ports[1], link_port=ports[2], worker_health_port=ports[3],
        worker_grpc_health_port=ports[4], edge_rest_port=ports[5], edge_grpc_port=ports[6],
        extra_workers=((ports[7], ports[8]),), extra_gateways=((ports[9], ports[10], ports[11]),),
        worker_args=worker_args, gateway_args=gateway_args, ready_timeout_s=600.0)
    stack = Stack(settings)
    try:
        stack.start()
    except BaseException:
        stack.stop()
        sentinels.stop()
        raise
    fleet = Fleet(stack, sentinels, {"worker": ports[3], "worker-2": ports[7]},
                  {"gateway": ports[0], "gateway-2": ports[9]})
    fleet.supervise_in_background()
    return fleet
