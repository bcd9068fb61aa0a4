"""Gateway entry point: REST (uvicorn) + public gRPC + link server in one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from typing import Any

import grpc
import redis.asyncio
import uvicorn
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis import exceptions as redis_errors

from common.redis_connect import async_client, is_sentinel_url
from common.tracing import configure as configure_tracing
from gateway.grpc_server import SERVING, _SERVICE_NAME, add_public_services
from gateway.link_server import add_link_service
from gateway.model_registry import load_models
from gateway.queue_watch import QueueWatch
from gateway.rest import create_app
from gateway.service import GatewayService
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


#: The kernel send buffer of every REST connection, bytes (Linux doubles it for its own
#: bookkeeping). Left to autotuning it grows to megabytes on loopback, and a client that stops
#: reading (behind nginx, whose own buffers add more) then takes thousands of tokens before the
#: gateway's send blocks and ``--stream-idle-timeout`` can cancel it (the chaos soak's stalled
#: reader, bench/RESULTS.md "Chaos soak"). 64 KiB is ~20 chunks of a token with logprobs:
#: nothing a reader that keeps up ever waits on.
REST_SEND_BUFFER_BYTES = 64 * 1024


def _rest_socket(host: str, port: int) -> socket.socket:
    """The REST listening socket on ``host``:``port`` (as uvicorn would bind it, without its
    exit on failure), with a bounded send buffer that every accepted connection inherits
    (:data:`REST_SEND_BUFFER_BYTES`).

    Raises:
        OSError: the address cannot be bound (in use, not local).
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, REST_SEND_BUFFER_BYTES)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: :func:`run` owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        """Leave SIGINT/SIGTERM to the gateway's own handlers (uvicorn would take them)."""
        yield


def load_tokenizer(settings: GatewaySettings) -> Any:
    """The default model's tokenizer (no torch): ``common.tokenizer.load_tokenizer`` on the
    path of the first of ``settings.model_specs()`` (gateway/model_config.py)."""
    from common.model_files import resolve_model_path
    from common.tokenizer import load_tokenizer as load

    return load(resolve_model_path(settings.model_specs()[0].path))


def link_keepalive(period_s: float) -> tuple[tuple[str, int], ...]:
    """HTTP/2 keepalive pings on worker links (gRPC core channel arguments): a ping every
    ``period_s`` seconds, the link declared lost when one goes unanswered for ``period_s``,
    so a worker that hangs without closing its socket (SIGSTOP, frozen, partitioned) is lost
    within twice that, and its requests become continuations (gateway/continuation.py).
    Pings go on while no data flows (a hung worker sends none). The unanswered ping's limit is
    ``grpc.http2.ping_timeout_ms`` in gRPC core 1.85 (pyproject: grpcio >= 1.85.1): with
    ``grpc.keepalive_timeout_ms`` alone a SIGSTOPped peer was never declared lost (checked
    with GRPC_TRACE=http_keepalive: the ping stayed in flight until SIGCONT)."""
    ms = max(1, int(period_s * 1000))
    return (("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms), ("grpc.http2.ping_timeout_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0))


def redis_client(settings: GatewaySettings) -> redis.asyncio.Redis:
    """An asyncio Redis client that fails fast (timeouts ``redis_timeout_s`` seconds) and retries
    a command once on a fresh connection, so the pooled connections a Redis restart closed do not
    fail the first requests after it. The retry must be ``redis.asyncio.retry.Retry``: the sync
    ``redis.retry.Retry`` never sees an asyncio command's error and silently does not retry.
    Only a connection error is retried, not a timeout: a Redis that hangs would otherwise cost
    twice ``redis_timeout_s`` before the client gets its 503.

    The pool blocks: with every one of its ``redis_max_connections`` connections busy (a burst
    of concurrent requests), a command waits for one instead of failing at once with "Too many
    connections", which the gateway would report as Redis being down (503).

    A ``redis+sentinel://`` URL (common/redis_connect.py) gives a client of the master that
    Sentinel names, found again after a failover; its pool does not block when full.

    Raises:
        ValueError: a malformed ``redis+sentinel://`` URL."""
    retry = Retry(NoBackoff(), 1, supported_errors=(redis_errors.ConnectionError,))
    if is_sentinel_url(settings.redis_url):  # the master through Sentinel: its own (non-blocking) pool
        return async_client(settings.redis_url, settings.redis_password, max_connections=settings.redis_max_connections,
                            socket_connect_timeout=settings.redis_timeout_s, socket_timeout=settings.redis_timeout_s,
                            retry=retry)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.redis_max_connections, timeout=settings.redis_timeout_s,
        **({"password": settings.redis_password} if settings.redis_password else {}),
        socket_connect_timeout=settings.redis_timeout_s, socket_timeout=settings.redis_timeout_s, retry=retry)
    return redis.asyncio.Redis.from_pool(pool)


async def _start_grpc(server: grpc.aio.Server, host: str, port: int, what: str) -> None:
    if not server.add_insecure_port(f"{host}:{port}"):
        raise OSError(f"cannot bind the {what} server to {host}:{port}")
    await server.start()


async def serve(settings: GatewaySettings, *, tokenizer: Any = None, tracer: Any = None,
                tokenizers: dict[str, Any] | None = None) -> None:
    """Run the gateway until cancelled: REST on ``rest_port``, gRPC on ``grpc_port``,
    the link server on ``link_port``. ``tokenizer`` (tests) skips loading the default
    model's, ``tokenizers`` (tests: model name -> tokenizer) those of the models named;
    ``tracer`` (tests: an in-memory exporter's) replaces the one ``common.tracing.configure``
    builds from ``otlp_traces_endpoint`` and the ``OTEL_*`` environment (None: off).

    Raises:
        OSError: a port cannot be bound.
    """
    if tracer is None:
        tracer = configure_tracing("inflight-gateway", settings.otlp_traces_endpoint)
    specs = settings.model_specs()
    given = dict(tokenizers or {})
    if tokenizer is not None:
        given.setdefault(specs[0].name, tokenizer)
    service = GatewayService(settings, redis_client(settings), tracer=tracer, models=load_models(specs, given))
    link_server, public_server = grpc.aio.server(options=link_keepalive(settings.link_keepalive_s)), grpc.aio.server()
    add_link_service(link_server, service.request_table, settings.link_secret, service.metrics, service.router)
    health_servicer = add_public_services(public_server, service)
    config = uvicorn.Config(create_app(service), host=settings.rest_host, port=settings.rest_port,
                            log_level="warning", lifespan="off", timeout_graceful_shutdown=settings.grace_s)
    rest = _Uvicorn(config)
    rest_socket = _rest_socket(settings.rest_host, settings.rest_port)
    rest_task: asyncio.Future | None = None
    watch = asyncio.ensure_future(QueueWatch(service.request_table, service.queue, service.continuations).run())
    try:
        await _start_grpc(link_server, settings.link_host, settings.link_port, "link")
        await _start_grpc(public_server, settings.grpc_host, settings.grpc_port, "gRPC")
        for name in ("", _SERVICE_NAME):
            await health_servicer.set(name, SERVING)
        rest_task = asyncio.ensure_future(rest.serve(sockets=[rest_socket]))
        await asyncio.shield(rest_task)
        if not rest.started:
            raise OSError(f"cannot start REST on {settings.rest_host}:{settings.rest_port}")
    finally:
        # Drain: refuse new requests, give open streams (SSE and gRPC alike, at the same
        # time) grace_s to finish; the link server stays up until then so the workers'
        # tokens still arrive.
        watch.cancel()
        await health_servicer.enter_graceful_shutdown()
        rest.should_exit = True
        await asyncio.gather(_finish_rest(rest_task, settings.grace_s), public_server.stop(settings.grace_s))
        await link_server.stop(0)
        await service.leases.close()  # its task would outlive the loop ("Task was destroyed")
        await service.redis.aclose()


async def _finish_rest(rest_task: asyncio.Future | None, grace_s: float) -> None:
    """Wait (at most ``grace_s`` seconds) for uvicorn to finish its open responses."""
    if rest_task is not None:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(rest_task), grace_s + 1)


def run(settings: GatewaySettings) -> None:
    """Blocking entry point: ``serve(settings)`` until SIGINT/SIGTERM."""
    async def main() -> None:
        task = asyncio.ensure_future(serve(settings))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(main())
