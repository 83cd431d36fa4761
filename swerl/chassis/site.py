"""Serving an aiohttp application on a host and port (0: one the kernel picks), for swerl's
small HTTP servers (the development servers, test proxies): the runner to clean up and the
port actually bound."""

from __future__ import annotations

from aiohttp import web


async def serve_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Starts `app` on host:port; returns its runner (`await runner.cleanup()` stops it) and the
    bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None and server.sockets  # type: ignore[attr-defined]
    return runner, int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
