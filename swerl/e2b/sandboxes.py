"""E2B sandboxes as pool leases: create, connect, kill, list, timeouts, snapshots.

A sandbox is a lease the face holds (renewed over the pool client's KeepAlive stream while the
face runs, so a dead face's sandboxes are reaped within the lease TTL), ended by a kill or when
its E2B timeout passes. Its id is the lease id; its envdAccessToken is the lease's capability
token as the pool issued it. A snapshot is a fork of the sandbox's lease that the face keeps
(swerl's forks: the filesystem is carried, processes are not); a create from a snapshot id forks
that lease again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY
from swerl.chassis.client import error_info
from swerl.e2b.procs import ProcessTable
from swerl.e2b.settings import E2BSettings
from swerl.exec.client import SandboxClient
from swerl.pool.client import Lease, PoolClient, sandbox_spec

log = structlog.get_logger("swerl.e2b")

# The envd version the face reports: the SDK enables octet-stream uploads, closing stdin and
# the default user from it.
ENVD_VERSION = "0.5.7"
SNAPSHOT_PREFIX = "snap-"


class ApiError(Exception):
    """A control-API failure: the HTTP status E2B answers and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass
class LeaseTarget:
    """Exec calls on a lease's sandbox, carrying the lease's current capability token, over the
    exec node's client on the lease's node (made with the target, closed with the lease)."""

    lease: Lease
    node: SandboxClient = field(init=False)

    def __post_init__(self) -> None:
        self.node = SandboxClient.for_lease(self.lease)

    @property
    def sandbox_id(self) -> str:
        return self.lease.sandbox_id

    def exec_call(self, timeout_s: float) -> Any:
        metadata = ((LEASE_TOKEN_METADATA_KEY, self.lease.token),)
        return self.node.exec_call(metadata=metadata, timeout_s=timeout_s)

    def commands_call(self, timeout_s: float) -> Any:
        metadata = ((LEASE_TOKEN_METADATA_KEY, self.lease.token),)
        return self.node.commands_call(metadata=metadata, timeout_s=timeout_s)


@dataclass
class Sandbox:
    sandbox_id: str
    lease: Lease
    template_id: str
    image: str
    metadata: dict[str, str]
    env_vars: dict[str, str]
    access_token: str
    started_at: float
    end_at: float
    processes: ProcessTable
    target: LeaseTarget
    closing: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "templateID": self.template_id,
            "sandboxID": self.sandbox_id,
            "clientID": "swerl",
            "startedAt": _iso(self.started_at),
            "endAt": _iso(self.end_at),
            "envdVersion": ENVD_VERSION,
            "cpuCount": 1,
            "memoryMB": 512,
            "diskSizeMB": 0,
            "metadata": self.metadata,
            "state": "running",
        }

    def created(self) -> dict[str, Any]:
        return {
            "templateID": self.template_id,
            "sandboxID": self.sandbox_id,
            "clientID": "swerl",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.access_token,
        }


@dataclass
class Snapshot:
    snapshot_id: str
    lease: Lease
    source_id: str
    template_id: str


def _iso(epoch: float) -> str:
    moment = dt.datetime.fromtimestamp(epoch, tz=dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _pool_error(err: grpc.aio.AioRpcError, what: str) -> ApiError:
    reason, _ = error_info(err)
    code = err.code()
    message = f"{what} failed: {reason or code.name}: {err.details()}"
    status = {
        grpc.StatusCode.NOT_FOUND: 404,
        grpc.StatusCode.INVALID_ARGUMENT: 400,
        grpc.StatusCode.FAILED_PRECONDITION: 400,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
        # A registry or node that cannot be reached: the gateway's upstream failed.
        grpc.StatusCode.UNAVAILABLE: 502,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504,
        grpc.StatusCode.UNAUTHENTICATED: 500,
        grpc.StatusCode.PERMISSION_DENIED: 500,
    }.get(code, 500)
    return ApiError(status, message)


class SandboxRegistry:
    """The face's sandboxes and snapshots, on one pool."""

    def __init__(self, pool: PoolClient, settings: E2BSettings) -> None:
        self.pool = pool
        self.settings = settings
        self.sandboxes: dict[str, Sandbox] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="e2b.reaper")

    def _timeout(self, timeout: Any) -> float:
        if timeout is None:
            return float(self.settings.default_timeout_s)
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
            raise ApiError(400, f"timeout must be a whole number of seconds, not {timeout!r}")
        if timeout > self.settings.max_timeout_s:
            raise ApiError(
                400, f"timeout {timeout} s is above this server's {self.settings.max_timeout_s} s"
            )
        return float(timeout)

    def image_of(self, template_id: str, metadata: Mapping[str, str]) -> str:
        key = self.settings.image_metadata_key
        if key and metadata.get(key):
            return metadata[key]
        return self.settings.templates.get(template_id, template_id)

    async def create(self, body: Mapping[str, Any]) -> Sandbox:
        template_id = body.get("templateID")
        if not isinstance(template_id, str) or not template_id:
            raise ApiError(400, "templateID is required")
        metadata = _string_map(body.get("metadata"), "metadata")
        env_vars = _string_map(body.get("envVars"), "envVars")
        timeout_s = self._timeout(body.get("timeout"))
        ttl = self.settings.lease_ttl_s
        owner = f"e2b/{template_id}"
        snapshot = self.snapshots.get(template_id)
        try:
            if snapshot is not None:
                [lease] = await self.pool.fork_leases(
                    snapshot.lease, 1, wait_s=self.settings.acquire_wait_s, owner=owner
                )
                image = snapshot.lease.info.image
            else:
                image = self.image_of(template_id, metadata)
                # The pool client's lease context renews the lease until it is left (kill).
                holder = contextlib.AsyncExitStack()
                lease = await holder.enter_async_context(
                    self.pool.lease(
                        image,
                        owner=owner,
                        wait_s=self.settings.acquire_wait_s,
                        ttl_s=ttl,
                        spec=sandbox_spec(env=env_vars, labels={"e2b.template": template_id}),
                    )
                )
        except grpc.aio.AioRpcError as err:
            raise _pool_error(err, f"creating a sandbox of {template_id!r}") from None
        now = time.time()
        target = LeaseTarget(lease)
        sandbox = Sandbox(
            sandbox_id=lease.lease_id,
            lease=lease,
            template_id=template_id,
            image=image,
            metadata=metadata,
            env_vars=env_vars,
            access_token=lease.token or secrets.token_hex(16),
            started_at=now,
            end_at=now + timeout_s,
            processes=ProcessTable(
                target,
                max_output_bytes=self.settings.max_output_bytes,
                max_poll_bytes=self.settings.max_poll_bytes,
            ),
            target=target,
        )
        if snapshot is None:
            sandbox.extra["holder"] = holder
        self.sandboxes[sandbox.sandbox_id] = sandbox
        log.info("e2b.sandbox_created", sandbox_id=sandbox.sandbox_id, image=image)
        return sandbox

    def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.closing:
            raise ApiError(404, f"sandbox {sandbox_id} not found")
        if sandbox.lease.lost.is_set():
            asyncio.get_running_loop().create_task(self.kill(sandbox_id))
            raise ApiError(404, f"sandbox {sandbox_id} not found (its lease was lost)")
        return sandbox

    def connect(self, sandbox_id: str, timeout: Any) -> Sandbox:
        sandbox = self.get(sandbox_id)
        if timeout is not None:
            sandbox.end_at = max(sandbox.end_at, time.time() + self._timeout(timeout))
        return sandbox

    def set_timeout(self, sandbox_id: str, timeout: Any) -> None:
        sandbox = self.get(sandbox_id)
        if timeout is None:
            raise ApiError(400, "timeout is required")
        sandbox.end_at = time.time() + self._timeout(timeout)

    def list(self, metadata: Mapping[str, str], states: set[str]) -> list[Sandbox]:
        if states and "running" not in states:
            return []
        return [
            s
            for s in self.sandboxes.values()
            if not s.closing
            and not s.lease.lost.is_set()
            and all(s.metadata.get(k) == v for k, v in metadata.items())
        ]

    async def kill(self, sandbox_id: str) -> bool:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.closing:
            return False
        sandbox.closing = True
        try:
            await sandbox.processes.close()
            await sandbox.lease.release()
            holder = sandbox.extra.get("holder")
            if holder is not None:
                await holder.aclose()
        finally:
            self.sandboxes.pop(sandbox_id, None)
        log.info("e2b.sandbox_killed", sandbox_id=sandbox_id)
        return True

    async def snapshot(self, sandbox_id: str, body: Mapping[str, Any]) -> Snapshot:
        sandbox = self.get(sandbox_id)
        if body.get("memory") is True:
            raise ApiError(
                400,
                "snapshot mode 'full' is not supported by swerl: its snapshots carry the"
                " filesystem only (mode='filesystem'), processes are not kept",
            )
        try:
            [lease] = await self.pool.fork_leases(
                sandbox.lease, 1, wait_s=self.settings.acquire_wait_s, owner="e2b/snapshot"
            )
        except grpc.aio.AioRpcError as err:
            raise _pool_error(err, f"snapshotting sandbox {sandbox_id}") from None
        # Held like any lease: its sandbox is kept alive on the node while the pool is away.
        SandboxClient.for_lease(lease)
        snapshot_id = SNAPSHOT_PREFIX + lease.lease_id
        self.snapshots[snapshot_id] = Snapshot(snapshot_id, lease, sandbox_id, sandbox.template_id)
        return self.snapshots[snapshot_id]

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        snapshot = self.snapshots.pop(snapshot_id, None)
        if snapshot is None:
            return False
        await snapshot.lease.release()
        return True

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for sandbox in list(self.sandboxes.values()):
                if sandbox.end_at <= now or sandbox.lease.lost.is_set():
                    with contextlib.suppress(Exception):
                        await self.kill(sandbox.sandbox_id)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(BaseException):
                await self._reaper
        for sandbox_id in list(self.sandboxes):
            with contextlib.suppress(Exception):
                await self.kill(sandbox_id)
        for snapshot_id in list(self.snapshots):
            with contextlib.suppress(Exception):
                await self.delete_snapshot(snapshot_id)


def _string_map(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ApiError(400, f"{name} must be an object of strings")
    return dict(value)
