"""Prometheus metrics of the gRPC boundary, and the HTTP endpoint that serves them.

Defined once at import, in the default registry: a process may run several servers (tests do),
and registering the same name twice would raise. `method` is the full gRPC method name
(`/swerl.exec.v1.SandboxService/Exec`), so servers in one process stay distinguishable.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

RPC_REQUESTS = Counter(
    "swerl_rpc_requests",
    "RPCs handled, by method and final status code.",
    ["method", "code"],
)

RPC_DURATION = Histogram(
    "swerl_rpc_duration_seconds",
    "Time from the call reaching the handler to its final status.",
    ["method"],
    # Streaming calls (Exec, EnsureImages, episodes) run for minutes, hence the long tail.
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
)

RPC_IN_FLIGHT = Gauge(
    "swerl_rpc_in_flight",
    "RPCs currently being handled.",
    ["method"],
)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # A scrape every few seconds would flood stderr.


def start_metrics_server(host: str, port: int) -> WSGIServer:
    """Serves the default registry on http://host:port/metrics from a daemon thread.

    `port=0` picks a free port (see `.server_port`); stop with `.shutdown()`, `.server_close()`.
    Written here rather than `prometheus_client.start_http_server`, which returns the server
    (and so the port picked for 0) only from prometheus-client 0.20.
    """

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(
        host.strip("[]"), port, make_wsgi_app(), server_class=Server, handler_class=_QuietHandler
    )
    # A short poll interval keeps shutdown() quick; the thread only idles between scrapes.
    threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="metrics", daemon=True
    ).start()
    return httpd
