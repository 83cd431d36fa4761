"""A real `swerl e2b serve` (embedded pool and node on the local dockerd) for the SDK tests.

The face runs on its own event loop in a thread, so the blocking E2B SDK (sync) and an async
test's own loop (async SDK) both talk to it over real HTTP on loopback ports. tests/e2b's
conftest starts one per module (`face`) with `running_face`.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from swerl.e2b.server import RunningFace, serve_face
from swerl.e2b.settings import E2BSettings
from swerl.pool.v1 import pool_pb2

API_KEY = "e2b-test-key"
IMAGE_KEY = "swerl-image"


@dataclass
class Face:
    face: RunningFace
    loop: asyncio.AbstractEventLoop

    @property
    def opts(self) -> dict[str, Any]:
        """The connection options an unmodified SDK gets from E2B_API_URL / E2B_SANDBOX_URL."""
        return {
            "api_key": API_KEY,
            "api_url": self.face.api_url,
            "sandbox_url": self.face.sandbox_url,
        }

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def live_leases(self) -> list[Any]:
        """The pool's leases of this face that have not ended."""

        async def listed() -> list[Any]:
            return [
                lease
                for lease in await self.face.registry.pool.list_leases()
                if lease.owner.startswith("e2b/") and lease.state != pool_pb2.LEASE_STATE_ENDED
            ]

        return self.call(listed())

    def node_ids(self) -> list[str]:
        """The exec nodes of this face's pool."""

        async def listed() -> list[str]:
            return [node.node_id for node in await self.face.registry.pool.list_nodes()]

        return self.call(listed())

    def containers(self) -> list[str]:
        """The E2B sandboxes' containers of this face's nodes (not another face's on the same
        dockerd)."""
        return e2b_containers(self.node_ids())

    def assert_nothing_left(self) -> None:
        """No lease of the face is live in the pool and no container of it is on dockerd."""
        deadline = time.monotonic() + 30
        while (self.live_leases() or self.containers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.live_leases() == []
        assert self.containers() == []


def e2b_containers(node_ids: list[str]) -> list[str]:
    """The E2B sandboxes' containers on dockerd of these nodes."""
    out = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            "label=swerl.user.e2b.template",
            "--format",
            '{{.ID}} {{.Label "swerl.node"}}',
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [row.split() for row in out.stdout.splitlines()]
    return [row[0] for row in rows if len(row) == 2 and row[1] in node_ids]


@contextlib.contextmanager
def running_face(base_image: str, **overrides: Any) -> Iterator[Face]:
    """A face (embedded pool and node) on its own event loop in a thread, with the tests'
    settings and any `overrides`."""
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "envd_port": 0,
        "auth_token": API_KEY,
        "image_metadata_key": IMAGE_KEY,
        "templates": {"base": base_image},
        "max_file_bytes": 64 << 20,
        "acquire_wait_s": 40.0,
        "log_level": "warning",
    }
    settings = E2BSettings(**{**options, **overrides})
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()
    stop = asyncio.Event()

    async def run() -> None:
        try:
            async with serve_face(settings) as running:
                ready["face"] = running
                started.set()
                await stop.wait()
        except BaseException as exc:  # surfaced to the fixture below
            ready["error"] = exc
            started.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    started.wait(120)
    if "error" in ready:
        raise ready["error"]
    try:
        yield Face(ready["face"], loop)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
