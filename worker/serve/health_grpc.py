"""Worker readiness over gRPC: the standard ``grpc.health.v1.Health`` service and
server reflection, on a port of their own (``--grpc-health-port``, default 9101).

The overall status (service name ``""``, what Kubernetes ``grpc:`` probes and
``grpc_health_probe`` ask for) is NOT_SERVING while the weights load and the
warm-up pass runs, SERVING after, and NOT_SERVING for good once the drain starts:
the same moments as the HTTP ``/ready`` (both follow ``worker.serve.health_http.HealthState``).

The server is the synchronous ``grpc.server`` on its own threads, so it answers
while the event loop is blocked by the model load or the warm-up pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

OVERALL = ""  # the server as a whole (grpc.health.v1 convention)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcHealthServer:
    """A running health + reflection server; flip it with :meth:`set_serving`, end it with :meth:`stop`.

    Attributes:
        port: the TCP port it listens on.
    """

    def __init__(self, server: grpc.Server, servicer: health.HealthServicer, port: int):
        self._server = server
        self._servicer = servicer
        self.port = port

    def set_serving(self, serving: bool) -> None:
        """SERVING when ``serving`` else NOT_SERVING (after :meth:`stop`, always NOT_SERVING)."""
        self._servicer.set(OVERALL, SERVING if serving else NOT_SERVING)

    def stop(self, grace_s: float = 1.0) -> None:
        """NOT_SERVING, then stop the server, waiting up to ``grace_s`` seconds for open RPCs."""
        self._servicer.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()


def start_grpc_health_server(host: str, port: int) -> GrpcHealthServer:
    """Serve ``grpc.health.v1.Health`` (NOT_SERVING at first) and reflection on ``host:port``.

    Raises:
        OSError: the address cannot be bound (port taken, bad host).
    """
    # Check is quick and Watch is non-blocking (HealthServicer's default): a few threads suffice.
    # No SO_REUSEPORT (grpc's default on Linux): a second worker on the same port must fail,
    # not share the port and answer the first one's probes.
    server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="grpc-health"),
                         options=[("grpc.so_reuseport", 0)])
    servicer = health.HealthServicer()
    servicer.set(OVERALL, NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection((health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises RuntimeError("Failed to bind ...")
        raise OSError(f"gRPC health server cannot bind {address}: {exc}") from exc
    if bound == 0:  # older grpcio reports failure as port 0
        raise OSError(f"gRPC health server cannot bind {address}")
    server.start()
    return GrpcHealthServer(server, servicer, bound)
