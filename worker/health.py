"""Worker liveness, readiness and metrics over HTTP (``/health``, ``/ready``, ``/metrics``).

``/ready`` answers 200 only after the weights are loaded and the warm-up forward
pass has run (the caller flips ``HealthState.ready``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


@dataclass
class HealthState:
    """Mutable readiness flag shared with the HTTP thread (a bool write is atomic)."""

    ready: bool = False
    draining: bool = False


def start_health_server(host: str, port: int, state: HealthState,
                        registry: CollectorRegistry) -> ThreadingHTTPServer:
    """Serve health endpoints on ``host:port`` from a daemon thread; returns the server
    (call ``shutdown()`` to stop). Raises OSError when the port is taken."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server naming
            if self.path == "/health":
                self._send(200, "application/json", b'{"status":"ok"}')
            elif self.path == "/ready":
                ok = state.ready and not state.draining
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
