"""Worker liveness, readiness and metrics over HTTP (``/health``, ``/ready``, ``/metrics``).

``/ready`` answers 200 only after the weights are loaded and the warm-up forward
pass has run (the caller calls ``HealthState.mark_ready``), and 503 again once the
drain starts (``HealthState.start_drain``). The gRPC health service
(``worker/serve/health_grpc.py``) follows the same state through ``on_change``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


@dataclass
class HealthState:
    """Readiness shared with the health threads (bool writes are atomic).

    ``ready``: weights loaded and warm-up ran; ``draining``: SIGTERM received. Change
    them through :meth:`mark_ready` and :meth:`start_drain` so that every listener
    registered with :meth:`on_change` sees the change at the same moment.
    """

    ready: bool = False
    draining: bool = False
    _listeners: list[Callable[[bool], None]] = field(default_factory=list, repr=False)

    @property
    def serving(self) -> bool:
        """True while the worker should take work: ready and not draining."""
        return self.ready and not self.draining

    def on_change(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(serving)`` now and after every change of :attr:`serving`'s inputs."""
        self._listeners.append(listener)
        listener(self.serving)

    def mark_ready(self) -> None:
        """Weights are loaded and the warm-up pass ran."""
        self.ready = True
        self._notify()

    def start_drain(self) -> None:
        """Stop reporting ready for good (SIGTERM/SIGINT)."""
        self.draining = True
        self._notify()

    def _notify(self) -> None:
        for listener in self._listeners:
            listener(self.serving)


def start_health_server(host: str, port: int, state: HealthState,
                        registry: CollectorRegistry) -> ThreadingHTTPServer:
    """Serve health endpoints on ``host:port`` from a daemon thread; returns the server
    (call ``shutdown()`` to stop). Raises OSError when the port is taken."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server naming
            if self.path == "/health":
                self._send(200, "application/json", b'{"status":"ok"}')
            elif self.path == "/ready":
                ok = state.serving
                body = json.dumps({"ready": ok, "draining": state.draining}).encode()
                self._send(200 if ok else 503, "application/json", body)
            elif self.path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            else:
                self._send(404, "application/json", b'{"error":"not found"}')

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep stderr for real problems
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="health").start()
    return server
