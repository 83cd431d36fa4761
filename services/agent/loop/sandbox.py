"""Where an episode's commands run: the `SandboxProvider` Protocol and its pool implementation.

The episode loop sees only `SandboxProvider.lease(...)` → a `SandboxHandle` (run a command, take
the diff, grade a patch, a `lost` event). `PoolSandboxProvider` implements it with the pool's
leases (swerl.pool.client) and, for each lease, the exec node's client on the lease's node
(swerl.exec.client, whose deadlines are the node's); gRPC failures of the node become
`EpisodeInfraError`, so the loop never handles grpc itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc

from swerl.agent.budget import DEFAULT_LEASE_WAIT_S
from swerl.agent.errors import EpisodeInfraError
from swerl.chassis.client import error_info
from swerl.exec.client import ExecResult, SandboxClient
from swerl.exec.v1 import evaluate_pb2
from swerl.pool.client import Lease, PoolClient


@dataclass(frozen=True)
class HarnessMount:
    """Where an in-sandbox harness finds its bundle and its gateway socket (paths inside the
    sandbox; see the exec node's OpenHarness)."""

    bundle_dir: str
    node: str
    harness_binary: str
    forwarder: str
    gateway_socket: str
    version: str


class SandboxHandle(Protocol):
    lease_id: str
    sandbox_id: str
    node_id: str
    lost: asyncio.Event

    def lost_detail(self) -> tuple[str, str]: ...

    async def run(
        self,
        command: str,
        *,
        timeout_s: float,
        env: Mapping[str, str],
        cwd: str,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Runs one command; `stdin`: exact bytes for its stdin (None: no stdin)."""
        ...

    async def diff(self) -> bytes: ...

    async def open_harness(self, harness: str, gateway_url: str, api_key: str) -> HarnessMount:
        """Readies the sandbox for an in-sandbox harness: the node's read-only bundle of it,
        and a socket in the sandbox's I/O directory bridged to `gateway_url` only."""
        ...

    async def evaluate(
        self, instance: evaluate_pb2.SweInstance, patch: bytes, timeout_s: float
    ) -> evaluate_pb2.EvaluationReport: ...


class ForkedSandbox(SandboxHandle, Protocol):
    """A copy of a held sandbox (a branch's): held until `release`, which is idempotent."""

    async def release(self) -> None: ...


class SandboxProvider(Protocol):
    def lease(
        self,
        image: str,
        *,
        owner: str,
        instance_id: str,
        request_id: str,
        workdir: str | None,
        avoid_node_ids: Sequence[str] = (),
    ) -> contextlib.AbstractAsyncContextManager[SandboxHandle]:
        """A held sandbox of `image`; `avoid_node_ids`: nodes to place it elsewhere than while
        another has room (EpisodeOptions.avoid_node_ids)."""
        ...

    async def fork(
        self, source: SandboxHandle, count: int, *, owner: str, request_id: str
    ) -> list[ForkedSandbox]:
        """`count` copies of `source` as it is now (files and all), each its own lease on
        the same node. Raises EpisodeInfraError(FORK_UNAVAILABLE) when they cannot be had."""
        ...


# The exec node's reason for a sandbox whose container stopped and could not be started again.
SANDBOX_NOT_RUNNING = "SANDBOX_NOT_RUNNING"

T = TypeVar("T")


async def guarded(sandbox: SandboxHandle, work: Awaitable[T]) -> T:
    """Awaits `work` unless the sandbox's lease is lost first (then INFRA_ERROR/LEASE_LOST)."""
    task = asyncio.ensure_future(work)
    lost = asyncio.ensure_future(sandbox.lost.wait())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        if sandbox.lost.is_set() and task.exception() is not None:
            raise lease_lost(sandbox)
        return task.result()
    raise lease_lost(sandbox)


def lease_lost(sandbox: SandboxHandle) -> EpisodeInfraError:
    """INFRA_ERROR/LEASE_LOST naming why the pool took the sandbox's lease away."""
    reason, message = sandbox.lost_detail()
    return EpisodeInfraError("LEASE_LOST", f"{reason}: {message}")


def _infra(
    err: grpc.aio.AioRpcError, what: str, fallback_reason: str = "SANDBOX_UNAVAILABLE"
) -> EpisodeInfraError:
    """INFRA_ERROR with the node's own reason (SANDBOX_STOPPED, DOCKER_UNAVAILABLE, ...), so the
    episode's result names the fault; `fallback_reason` only when the node gave none (it could
    not be reached, or the call's deadline passed)."""
    reason, _ = error_info(err)
    return EpisodeInfraError(
        reason or fallback_reason,
        f"{what} failed: {err.code().name} {reason or ''} {err.details()}",
        node_down=reason == "DOCKER_UNAVAILABLE"
        or (not reason and err.code() == grpc.StatusCode.UNAVAILABLE),
    )


@dataclass
class _PoolHandle:
    lease: Lease
    # The exec node's client on the lease's node, attached to the lease (closed with it).
    node: SandboxClient
    lease_id: str
    sandbox_id: str
    node_id: str
    lost: asyncio.Event

    @classmethod
    def of(cls, lease: Lease) -> _PoolHandle:
        """The handle of a held lease, its node's client made (and attached) at once: the
        lease then keeps its sandbox alive on the node through it while the pool is away."""
        node = SandboxClient.for_lease(lease)
        return cls(lease, node, lease.lease_id, lease.sandbox_id, lease.node_id, lease.lost)

    async def release(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.lease.release()

    def lost_detail(self) -> tuple[str, str]:
        lease = self.lease
        return (lease.lost_reason or "UNSPECIFIED", lease.lost_message)

    async def run(
        self,
        command: str,
        *,
        timeout_s: float,
        env: Mapping[str, str],
        cwd: str,
        stdin: bytes | None = None,
    ) -> ExecResult:
        try:
            return await self.node.run(
                self.sandbox_id, command, timeout_s=timeout_s, env=dict(env), cwd=cwd, stdin=stdin
            )
        except grpc.aio.AioRpcError as err:
            if error_info(err)[0] == SANDBOX_NOT_RUNNING:  # the episode decides whose doing
                raise EpisodeInfraError(SANDBOX_NOT_RUNNING, err.details() or "") from err
            raise _infra(err, "Exec") from err

    async def diff(self) -> bytes:
        try:
            response = await self.node.diff(self.sandbox_id, include_untracked=True)
        except grpc.aio.AioRpcError as err:
            raise _infra(err, "GetDiff") from err
        return bytes(response.patch)

    async def open_harness(self, harness: str, gateway_url: str, api_key: str) -> HarnessMount:
        try:  # a first call on a node builds the bundle (minutes at most)
            opened = await self.node.open_harness(
                self.sandbox_id, harness, gateway_url=gateway_url, gateway_api_key=api_key
            )
        except grpc.aio.AioRpcError as err:
            raise _infra(err, "OpenHarness") from err
        return HarnessMount(
            bundle_dir=opened.bundle_dir,
            node=opened.node,
            harness_binary=opened.harness_binary,
            forwarder=opened.forwarder,
            gateway_socket=opened.gateway_socket,
            version=opened.version,
        )

    async def evaluate(
        self, instance: evaluate_pb2.SweInstance, patch: bytes, timeout_s: float
    ) -> evaluate_pb2.EvaluationReport:
        try:
            report = await self.node.evaluation_report(
                instance, patch, sandbox_id=self.sandbox_id, timeout_s=timeout_s
            )
        except grpc.aio.AioRpcError as err:
            raise _infra(err, "Evaluate", fallback_reason="EVALUATION_UNAVAILABLE") from err
        if report is None:
            raise EpisodeInfraError("EVALUATION_UNAVAILABLE", "Evaluate ended without a report")
        return report


class PoolSandboxProvider:
    """Leases sandboxes from a swerl pool (`swerl.pool.client.PoolClient`)."""

    def __init__(self, pool: PoolClient, *, lease_wait_s: float = DEFAULT_LEASE_WAIT_S) -> None:
        self._pool = pool
        self._wait_s = lease_wait_s
        # Releases of leases whose node stopped answering, running on after their episode ended.
        self._releasing: set[asyncio.Task[None]] = set()

    def _release_in_background(self, context: Any, exc: BaseException) -> None:
        """Releases a lease whose node is down (it does not answer, or its dockerd does not)
        without holding up the episode's end: the pool waits (its `release_wait_s`, 5 s) for a
        destroy the node cannot do now, and the caller (a trainer's rollout waiting for its
        slowest episode) would wait with it. The pool still releases the lease, and the sandbox
        is destroyed once the node (or its dockerd) answers again."""

        async def release() -> None:
            with contextlib.suppress(Exception):
                await context.__aexit__(type(exc), exc, exc.__traceback__)

        task = asyncio.get_running_loop().create_task(release(), name="agent.lease-release")
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    @contextlib.asynccontextmanager
    async def lease(
        self,
        image: str,
        *,
        owner: str,
        instance_id: str,
        request_id: str,
        workdir: str | None,
        avoid_node_ids: Sequence[str] = (),
    ) -> AsyncIterator[SandboxHandle]:
        try:
            context = self._pool.lease(
                image,
                owner=owner,
                instance_id=instance_id,
                request_id=request_id,
                wait_s=self._wait_s,
                workdir=workdir,
                prefer_not_node_ids=avoid_node_ids,
            )
            lease = await context.__aenter__()
        except grpc.aio.AioRpcError as err:
            reason, _ = error_info(err)
            raise EpisodeInfraError(
                "LEASE_UNAVAILABLE",
                f"AcquireLease failed: {err.code().name} {reason or ''} {err.details()}",
            ) from err
        handle = _PoolHandle.of(lease)
        try:
            yield handle
        except BaseException as exc:
            if isinstance(exc, EpisodeInfraError) and exc.node_down:
                self._release_in_background(context, exc)
                raise
            with contextlib.suppress(Exception):
                await context.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        else:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await context.__aexit__(None, None, None)

    async def fork(
        self, source: SandboxHandle, count: int, *, owner: str, request_id: str
    ) -> list[ForkedSandbox]:
        lease = getattr(source, "lease", None)
        if lease is None:
            raise EpisodeInfraError("FORK_UNAVAILABLE", "the sandbox was not leased from a pool")
        try:
            leases = await self._pool.fork_leases(
                lease, count, request_id=request_id, wait_s=self._wait_s, owner=owner
            )
        except grpc.aio.AioRpcError as err:
            reason, _ = error_info(err)
            raise EpisodeInfraError(
                "FORK_UNAVAILABLE",
                f"ForkLease failed: {err.code().name} {reason or ''} {err.details()}",
            ) from err
        return [_PoolHandle.of(x) for x in leases]
