"""`swerl e2b serve`: the control API and the sandbox API on their ports, over a pool.

With no pool address the face runs the embedded default of `swerl demo`: an in-process pool and
exec node on the local dockerd (`swerl.stack.local_stack`), torn down with the face.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from swerl.e2b.api import make_api_app
from swerl.e2b.envd import make_envd_app
from swerl.e2b.sandboxes import SandboxRegistry
from swerl.e2b.settings import E2BSettings
from swerl.pool.client import PoolClient


@dataclass
class RunningFace:
    api_port: int
    envd_port: int
    registry: SandboxRegistry
    pool_address: str
    pool_token: str | None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def sandbox_url(self) -> str:
        return f"http://127.0.0.1:{self.envd_port}"


def _ssl_context(settings: E2BSettings) -> ssl.SSLContext | None:
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file is not None:
        context.load_verify_locations(settings.tls_client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@contextlib.asynccontextmanager
async def _pool(settings: E2BSettings) -> AsyncIterator[tuple[str, str | None]]:
    if settings.pool is not None:
        yield settings.pool, settings.pool_bearer()
        return
    from swerl.stack import local_stack

    # The embedded pool and node take the face's token (a fresh one under --insecure), so an
    # operator can reach them too.
    async with local_stack(
        nodes=1,
        max_sandboxes=settings.embedded_max_sandboxes,
        purpose="e2b",
        token=settings.pool_bearer(),
    ) as stack:
        yield stack.pool_address, stack.token


@contextlib.asynccontextmanager
async def serve_face(settings: E2BSettings) -> AsyncIterator[RunningFace]:
    """Runs the face until the context is left; then kills its sandboxes and snapshots."""
    async with _pool(settings) as (address, token):
        pool = PoolClient(address, token=token)
        registry = SandboxRegistry(pool, settings)
        registry.start()
        api_key = settings.auth_token.get_secret_value() if settings.auth_token else ""
        runners = [
            web.AppRunner(make_api_app(registry, api_key), access_log=None),
            web.AppRunner(
                make_envd_app(registry, max_file_bytes=settings.max_file_bytes), access_log=None
            ),
        ]
        context = _ssl_context(settings)
        try:
            ports = []
            for runner, port in zip(runners, (settings.port, settings.envd_port), strict=True):
                await runner.setup()
                site = web.TCPSite(runner, settings.host, port, ssl_context=context)
                await site.start()
                ports.append(runner.addresses[0][1])
            yield RunningFace(ports[0], ports[1], registry, address, token)
        finally:
            await registry.close()
            for runner in runners:
                await runner.cleanup()
            await pool.close()


async def serve_until_cancelled(settings: E2BSettings) -> None:
    async with serve_face(settings) as face:
        print(
            f"swerl e2b: control API on {settings.host}:{face.api_port} (E2B_API_URL),"
            f" sandbox API on {settings.host}:{face.envd_port} (E2B_SANDBOX_URL),"
            f" pool {face.pool_address}",
            flush=True,
        )
        await asyncio.Event().wait()
