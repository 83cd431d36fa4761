"""`GrpcServer`: the aio gRPC server every swerl service runs, with everything around its servicers.

`ServiceHost` is the face each service's assembly (ExecNode, PoolServer, AgentServer, PrmServer)
shows around its GrpcServer, and `serve_main` is the one body of every `swerl <service> serve`.

It adds health and reflection, the boundary interceptor (request ids, auth, errors, the `rpc` log
line, metrics), TLS, a Prometheus endpoint, and the shutdown sequence: health NOT_SERVING, drain
in-flight calls for a grace period, run shutdown callbacks; on SIGTERM, then exit 0.

    server = GrpcServer(settings, name="exec")
    server.add_service(sandbox_pb2_grpc.add_SandboxServiceServicer_to_server, servicer,
                       [sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name])
    server.add_shutdown_callback(backend.close)
    await server.serve_until_signal()
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from swerl.chassis.client import MAX_MESSAGE_BYTES
from swerl.chassis.health import OVERALL, HealthServicer
from swerl.chassis.interceptors import HEALTH_SERVICE, BoundaryInterceptor
from swerl.chassis.logging import configure_logging
from swerl.chassis.metrics import start_metrics_server
from swerl.chassis.settings import ServiceSettings, settings_from_args

if TYPE_CHECKING:
    import argparse

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Accept the clients' keepalive pings (client.CHANNEL_OPTIONS: every 30 s, idle too);
    # by default a ping more often than every 5 min without data gets the connection closed.
    # The key is core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, whose string has
    # no "recv" in it: spelled after the macro, gRPC ignored it silently and a stream silent
    # for ~90 s (an episode waiting on its evaluation) died with GOAWAY too_many_pings.
    # Exec node channels ping every 2 s (swerl.exec.client.NODE_CHANNEL_OPTIONS), so that a
    # stopped node is noticed in seconds: pings a second apart are welcome.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    # Our own pings find clients that vanished mid-stream, so their Exec gets cancelled.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)

_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "[::]": "::1"}
_log = structlog.get_logger("swerl.server")

ShutdownCallback = Callable[[], Awaitable[None]]
SettingsT = TypeVar("SettingsT", bound=ServiceSettings)


class GrpcServer:
    """One gRPC server: register servicers, `start()` (or `serve_until_signal()`), `stop()`."""

    def __init__(self, settings: ServiceSettings, *, name: str) -> None:
        self._settings = settings
        self._name = name
        self._services: list[tuple[Callable[[Any, grpc.aio.Server], None], object]] = []
        self._service_names: list[str] = []
        self._shutdown_callbacks: list[ShutdownCallback] = []
        self._health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._bound_port: int | None = None
        self._metrics_httpd: Any = None
        self._metrics_port: int | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._force_stop: asyncio.Future[None] | None = None

    def add_service(
        self,
        add_fn: Callable[[Any, grpc.aio.Server], None],
        servicer: object,
        service_names: Sequence[str],
    ) -> None:
        """Registers a servicer, e.g. `add_SandboxServiceServicer_to_server`, before `start`.

        `service_names` are the full names (`swerl.exec.v1.SandboxService`) the servicer serves,
        for health and reflection.
        """
        if self._server is not None:
            raise RuntimeError("add_service must be called before start()")
        self._services.append((add_fn, servicer))
        self._service_names.extend(service_names)

    def add_shutdown_callback(self, callback: ShutdownCallback) -> None:
        """Runs `await callback()` after in-flight calls drained, in registration order."""
        self._shutdown_callbacks.append(callback)

    async def start(self) -> int:
        """Binds, starts serving and marks every service SERVING; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("server already started")
        settings = self._settings
        token = settings.auth_token.get_secret_value() if settings.auth_token else None
        server = grpc.aio.server(
            interceptors=[BoundaryInterceptor(auth_token=None if settings.insecure else token)],
            options=SERVER_OPTIONS,
        )
        for add_fn, servicer in self._services:
            add_fn(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self._service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], server
        )
        await self.set_serving(True)
        self._start_metrics()
        try:
            self._bound_port = self._bind(server)
            await server.start()
        except BaseException:
            await self._stop_metrics()
            raise
        self._server = server
        _log.info(
            "server.started",
            server=self._name,
            address=f"{_host_for_address(settings.host)}:{self._bound_port}",
            metrics_port=self._metrics_port,
            tls=settings.tls_cert_file is not None,
            client_auth=settings.tls_client_ca_file is not None,
            insecure=settings.insecure,
        )
        if settings.insecure:
            _log.warning("server.insecure", server=self._name, detail="calls are not authenticated")
        return self._bound_port

    @property
    def bound_port(self) -> int:
        if self._bound_port is None:
            raise RuntimeError("server not started")
        return self._bound_port

    @property
    def address(self) -> str:
        """The `host:port` a local client can dial (a wildcard bind host becomes loopback)."""
        host = _WILDCARD_HOSTS.get(self._settings.host, self._settings.host)
        return f"{_host_for_address(host)}:{self.bound_port}"

    @property
    def metrics_port(self) -> int | None:
        """Port of the Prometheus endpoint, or None when it is disabled."""
        return self._metrics_port

    async def set_serving(self, serving: bool, service: str | None = None) -> None:
        """Sets the health of one service, or of every registered service and the server."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        services = [service] if service is not None else [OVERALL, *self._service_names]
        for name in services:
            await self._health.set(name, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops once, whoever calls: NOT_SERVING, drain for `grace_s`, then callbacks.

        `grace_s=None` uses the `drain_grace_s` setting; calls still running after it are
        cancelled. Concurrent and later calls wait for the same stop.
        """
        if self._stopping is None:
            grace = self._settings.drain_grace_s if grace_s is None else grace_s
            self._stopping = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def serve_until_signal(self) -> None:
        """Serves until SIGTERM or SIGINT, then stops gracefully and returns (exit status 0).

        A second signal cancels the calls still draining.
        """
        if self._server is None:
            await self.start()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for signum in signals:
            loop.add_signal_handler(signum, self._on_signal, signum)
        try:
            await self._wait_stopped()
        finally:
            for signum in signals:
                loop.remove_signal_handler(signum)

    async def __aenter__(self) -> GrpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._stopping is None:
            _log.info("server.signal", server=self._name, signal=name, action="drain")
            self._stopping = asyncio.ensure_future(self._stop(self._settings.drain_grace_s))
        elif self._server is not None:
            _log.warning("server.signal", server=self._name, signal=name, action="cancel_calls")
            # A second stop(None) makes the draining stop cancel what is left at once.
            self._force_stop = asyncio.ensure_future(self._server.stop(None))

    async def _wait_stopped(self) -> None:
        assert self._server is not None
        # The server can also end without a signal: stop() from elsewhere, or a crash.
        await self._server.wait_for_termination()
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float) -> None:
        if self._server is not None:
            _log.info("server.draining", server=self._name, grace_s=grace_s)
            # Health first, so balancers and the pool stop sending work while calls drain.
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace_s)
        await self._stop_metrics()
        for callback in self._shutdown_callbacks:
            try:
                await callback()
            except Exception:
                _log.exception("server.shutdown_callback_failed", server=self._name)
        _log.info("server.stopped", server=self._name)

    def _bind(self, server: grpc.aio.Server) -> int:
        settings = self._settings
        address = f"{_host_for_address(settings.host)}:{settings.port}"
        if settings.tls_cert_file is not None and settings.tls_key_file is not None:
            client_ca = settings.tls_client_ca_file
            credentials = grpc.ssl_server_credentials(
                [(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())],
                root_certificates=client_ca.read_bytes() if client_ca else None,
                require_client_auth=client_ca is not None,
            )
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:  # Older grpcio reports a failed bind as port 0 instead of raising.
            raise RuntimeError(f"could not bind {address}")
        return port

    def _start_metrics(self) -> None:
        if self._settings.metrics_port is None:
            return
        httpd = start_metrics_server(self._settings.host, self._settings.metrics_port)
        self._metrics_httpd = httpd
        self._metrics_port = httpd.server_port

    async def _stop_metrics(self) -> None:
        if self._metrics_httpd is not None:
            httpd, self._metrics_httpd = self._metrics_httpd, None
            await asyncio.to_thread(httpd.shutdown)  # Blocks until its serve loop exits.
            httpd.server_close()


def _host_for_address(host: str) -> str:
    # IPv6 literals need brackets in "host:port".
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ServiceHost:
    """One running service: `start()` then `serve_until_signal()` or `stop()`.

    A service's assembly builds its domain and its GrpcServer (`self.server`) in `__init__`, and
    overrides `start` when its domain starts before the server or work follows it.
    """

    server: GrpcServer
    port: int = 0

    async def start(self) -> int:
        self.port = await self.server.start()
        return self.port

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.stop(grace_s)

    async def serve_until_signal(self) -> None:
        await self.server.serve_until_signal()


def serve_main(
    settings_class: type[SettingsT],
    args: argparse.Namespace,
    build: Callable[[SettingsT], ServiceHost],
    banner: Callable[[SettingsT, int], str],
    *,
    started: Callable[[SettingsT], None] | None = None,
) -> int:
    """The body of `swerl <service> serve`: settings from the command line (and environment),
    logging, the service built inside the event loop and started, `started` (process-wide tuning
    once it runs), one banner line on stdout (launchers wait for it), then serving until SIGTERM
    or SIGINT. Returns the exit status, 0."""
    settings = settings_from_args(settings_class, args)
    configure_logging(settings.log_format, settings.log_level)

    async def main() -> None:
        host = build(settings)
        port = await host.start()
        if started is not None:
            started(settings)
        print(banner(settings, port), flush=True)
        await host.serve_until_signal()

    asyncio.run(main())
    return 0
