"""The gateway bridge: a sandbox's only way out, to its episode's gateway session.

For a harness sandbox the node serves HTTP on a unix socket in the sandbox's own I/O directory
(`<io>/gateway.sock`, seen inside as `/.swerl-io/gateway.sock`) and relays every request to one
base URL, the episode's gateway session (`http://gateway/s/<session>`): a request for `/v1/messages`
goes to `<session>/v1/messages`, so nothing but that session can be reached through it. The
session's secret, when given, is added by the node; the sandbox never holds it. The sandbox's
network stays `none`; the forwarder from the bundle gives its harness an ordinary
`http://127.0.0.1:PORT` in front of the socket.

A bridge lives as long as its sandbox (closed when the sandbox is destroyed); opening it again
points it at a new session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import structlog
from aiohttp import web

from swerl.exec.errors import InvalidGatewayUrl

log = structlog.get_logger(__name__)

# The socket's name in the sandbox's I/O directory.
BRIDGE_SOCKET = "gateway.sock"
# Headers that belong to one hop, never relayed; the node sets the credentials itself.
_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key"})


def check_gateway_url(url: str) -> str:
    """The session's base URL without a trailing slash; http(s) with a host, no query."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise InvalidGatewayUrl(f"gateway_url must be an http(s) base URL, got {url!r}")
    return url.rstrip("/")


def _bound_unix_socket(path: Path) -> socket.socket:
    """A listening unix socket at `path`, bound through its directory's descriptor: a node's
    state directory may be deeper than a socket address allows (108 bytes)."""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"/proc/self/fd/{directory}/{path.name}")
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(directory)
    return sock


@dataclass
class _Bridge:
    sandbox_id: str
    socket_path: Path
    target: str
    api_key: str
    runner: web.AppRunner | None = None
    client: aiohttp.ClientSession | None = None
    # Requests relayed, and those the gateway could not be reached for.
    relayed: int = 0
    unreachable: int = 0

    async def start(self) -> None:
        self.client = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        )
        app = web.Application(client_max_size=256 << 20)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        await web.SockSite(self.runner, _bound_unix_socket(self.socket_path)).start()
        os.chmod(self.socket_path, 0o666)  # whatever user the sandbox's harness runs as

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.client is not None:
            await self.client.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self.client is not None
        url = self.target + request.rel_url.raw_path_qs
        headers = {
            key: value
            for key, value in request.headers.items()
            if key.lower() not in _HOP_HEADERS
            and (not self.api_key or key.lower() not in _CREDENTIAL_HEADERS)
        }
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
            headers["x-api-key"] = self.api_key
        body = await request.read()
        self.relayed += 1
        try:
            async with self.client.request(
                request.method, url, headers=headers, data=body, allow_redirects=False
            ) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for key, value in upstream.headers.items():
                    if key.lower() not in _HOP_HEADERS:
                        response.headers.add(key, value)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientConnectionError as exc:
            self.unreachable += 1
            log.warning("bridge.unreachable", sandbox_id=self.sandbox_id, error=str(exc))
            # Both faces' clients read a JSON error body; this one names the bridge.
            return web.json_response(
                {
                    "type": "error",
                    "error": {
                        "type": "api_error",
                        "message": f"swerl gateway bridge: the gateway is unreachable ({exc})",
                    },
                },
                status=502,
            )


class GatewayBridges:
    """The node's bridges, one per harness sandbox."""

    def __init__(self) -> None:
        self._bridges: dict[str, _Bridge] = {}
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    async def open(self, sandbox_id: str, io_dir: Path, gateway_url: str, api_key: str) -> Path:
        """Serves the sandbox's socket, relaying to `gateway_url`; returns the socket's host
        path. Opening it again replaces the target."""
        target = check_gateway_url(gateway_url)
        async with self._lock:
            old = self._bridges.pop(sandbox_id, None)
            if old is not None:
                await old.close()
            bridge = _Bridge(sandbox_id, io_dir / BRIDGE_SOCKET, target, api_key)
            await bridge.start()
            self._bridges[sandbox_id] = bridge
        log.info("bridge.opened", sandbox_id=sandbox_id, target=target)
        return bridge.socket_path

    def counts(self, sandbox_id: str) -> tuple[int, int]:
        """(requests relayed, requests that found the gateway unreachable); zeros when none."""
        bridge = self._bridges.get(sandbox_id)
        return (bridge.relayed, bridge.unreachable) if bridge else (0, 0)

    async def close(self, sandbox_id: str) -> None:
        async with self._lock:
            bridge = self._bridges.pop(sandbox_id, None)
        if bridge is not None:
            await bridge.close()
            log.info("bridge.closed", sandbox_id=sandbox_id)

    def close_soon(self, sandbox_id: str) -> None:
        """For SandboxManager.after_destroy (a plain callback): closes the bridge in a task."""
        if sandbox_id in self._bridges:
            task = asyncio.get_running_loop().create_task(self.close(sandbox_id))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close_all(self) -> None:
        for sandbox_id in list(self._bridges):
            await self.close(sandbox_id)
