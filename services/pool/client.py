"""Async client of the pool and of a leased sandbox's node: what the agent service and tools use.

    pool = PoolClient("head:18090", token=TOKEN)
    async with pool.lease("swerl-examples/x:latest", owner="agent-3/ep-17") as lease:
        result = await lease.run("git status")              # Exec on the node, token attached
        if lease.lost.is_set(): ...                          # the pool reported the lease lost
    await pool.close()

The lease context renews the lease over one KeepAlive stream in the background (reconnecting
with backoff while the pool restarts), watches for `lost`, and releases the lease on exit, even
when the body is cancelled. Calls are retried only where idempotent: AcquireLease and
ReleaseLease carry a request_id, KeepAlive renewals are naturally idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import structlog

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY
from swerl.chassis.client import make_channel
from swerl.chassis.retry import async_retrying
from swerl.chassis.timeconv import duration_pb
from swerl.exec.client import ExecResult, SandboxClient
from swerl.exec.v1 import evaluate_pb2_grpc
from swerl.exec.v1 import sandbox_pb2 as exec_pb
from swerl.pool.v1 import pool_pb2 as pb
from swerl.pool.v1 import pool_pb2_grpc

log = structlog.get_logger("swerl.pool.client")

_FOREVER = 10**9


class LeaseLost(Exception):
    """The pool reported the lease lost (node down, sandbox gone, expired, revoked)."""

    def __init__(self, lease_id: str, reason: str, message: str) -> None:
        super().__init__(f"lease {lease_id} lost ({reason}): {message}")
        self.lease_id = lease_id
        self.reason = reason
        self.message = message


def _ts(ts: Any) -> float:
    return ts.seconds + ts.nanos / 1e9


def sandbox_spec(
    *,
    workdir: str | None = None,
    env: Mapping[str, str] | None = None,
    cpus: float = 0.0,
    memory_bytes: int = 0,
    pids: int = 0,
    labels: Mapping[str, str] | None = None,
) -> pb.SandboxSpec:
    return pb.SandboxSpec(
        workdir=workdir or "",
        env=dict(env or {}),
        resources=exec_pb.Resources(cpus=cpus, memory_bytes=memory_bytes, pids=pids),
        labels=dict(labels or {}),
    )


class Lease:
    """A held lease: where its sandbox is, clients for it, and whether it is still alive."""

    def __init__(
        self, pool: PoolClient, message: pb.Lease, *, ttl_s: float, keepalive_interval_s: float
    ) -> None:
        self.info = message
        self.lease_id = message.lease_id
        self.sandbox_id = message.sandbox_id
        self.node_id = message.node_id
        self.node_address = message.node_address
        self.token = message.token
        self.expire_time = _ts(message.expire_time)
        self.from_warm_spare = message.from_warm_spare
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self.lost_message = ""
        self._pool = pool
        self._ttl_s = ttl_s
        self._interval_s = keepalive_interval_s
        self.channel = make_channel(
            self.node_address,
            token=pool.token,
            tls_ca_file=pool.tls_ca_file,
            metadata_provider=self._token_metadata,
        )
        self.sandbox = SandboxClient(self.channel)
        self.evaluate = evaluate_pb2_grpc.EvaluateServiceStub(self.channel)
        self._keepalive: asyncio.Task[None] | None = None
        self._released = False

    def _token_metadata(self) -> list[tuple[str, str]]:
        return [(LEASE_TOKEN_METADATA_KEY, self.token)] if self.token else []

    async def run(self, command: str, **kwargs: Any) -> ExecResult:
        """Runs one command in the lease's sandbox (see SandboxClient.run)."""
        return await self.sandbox.run(self.sandbox_id, command, **kwargs)

    def raise_if_lost(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(self.lease_id, self.lost_reason or "UNSPECIFIED", self.lost_message)

    def _set_lost(self, reason: str, message: str) -> None:
        if not self.lost.is_set():
            self.lost_reason, self.lost_message = reason, message
            self.lost.set()
            log.warning("lease.lost", lease_id=self.lease_id, reason=reason, message=message)

    def start_keepalive(self) -> None:
        self._keepalive = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name=f"keepalive.{self.lease_id}"
        )

    async def _keepalive_loop(self) -> None:
        while not self.lost.is_set():
            try:
                # Reconnects with the one backoff policy while the pool is away (UNAVAILABLE).
                async for attempt in async_retrying(
                    max_attempts=_FOREVER, max_delay_s=_FOREVER, max_wait_s=2.0
                ):
                    with attempt:
                        await self._session()
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.CANCELLED:
                    self._set_lost("UNSPECIFIED", f"KeepAlive failed: {err.code().name}")
                    return
            if not self.lost.is_set():
                await asyncio.sleep(0.2)

    async def _session(self) -> None:
        """One KeepAlive stream; returns when the lease is lost or the pool ended the stream."""
        # Past its expiry by far, the nodes have reaped the sandbox whatever the pool says.
        if time.time() >= self.expire_time + max(30.0, 2 * self._ttl_s):
            self._set_lost("EXPIRED", "the lease could not be renewed before its expiry")
            return
        renew = pb.KeepAliveRequest(
            renew=pb.KeepAliveRenew(lease_id=self.lease_id, ttl=duration_pb(self._ttl_s))
        )
        call = self._pool.stub.KeepAlive()

        async def ticker() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                while True:
                    await call.write(renew)
                    await asyncio.sleep(self._interval_s)

        tick = asyncio.get_running_loop().create_task(ticker())
        try:
            async for response in call:
                kind = response.WhichOneof("kind")
                if kind == "expiry":
                    self.token = response.expiry.token or self.token
                    self.expire_time = _ts(response.expiry.expire_time)
                elif kind == "lost":
                    reason = pb.LeaseLossReason.Name(response.lost.reason)
                    self._set_lost(reason.removeprefix("LEASE_LOSS_REASON_"), response.lost.message)
                    return
        finally:
            tick.cancel()
            with contextlib.suppress(BaseException):
                await tick
            call.cancel()

    async def release(self) -> bool:
        """Releases the lease (idempotent) and closes its node channel."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(BaseException):
                await self._keepalive
        existed = False
        if not self._released:
            self._released = True
            try:
                existed = await self._pool.release(self.lease_id)
            finally:
                await self.channel.close()
        return existed


class PoolClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        tls_ca_file: str | None = None,
        call_timeout_s: float = 30.0,
    ) -> None:
        self.address = address
        self.token = token
        self.tls_ca_file = tls_ca_file
        self.call_timeout_s = call_timeout_s
        # A restarted pool is found again within a couple of seconds, not after gRPC's
        # default reconnect backoff (up to two minutes).
        self.channel = make_channel(
            address,
            token=token,
            tls_ca_file=tls_ca_file,
            extra_options=(
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ),
        )
        self.stub = pool_pb2_grpc.PoolServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def acquire(
        self,
        image: str,
        *,
        owner: str = "",
        instance_id: str = "",
        request_id: str | None = None,
        wait_s: float = 60.0,
        ttl_s: float | None = None,
        spec: pb.SandboxSpec | None = None,
        node_selector: Mapping[str, str] | None = None,
    ) -> pb.Lease:
        """AcquireLease, retried with the same request_id while the pool is unreachable."""
        request = pb.AcquireLeaseRequest(
            request_id=request_id or uuid.uuid4().hex,
            image=image,
            instance_id=instance_id,
            owner=owner,
            ttl=duration_pb(ttl_s or 0.0),
            wait_timeout=duration_pb(wait_s),
            spec=spec,
            node_selector=dict(node_selector or {}),
        )
        async for attempt in async_retrying(max_delay_s=max(30.0, wait_s)):
            with attempt:
                response = await self.stub.AcquireLease(request, timeout=wait_s + 60.0)
        return response.lease

    async def release(self, lease_id: str) -> bool:
        request = pb.ReleaseLeaseRequest(request_id=uuid.uuid4().hex, lease_id=lease_id)
        async for attempt in async_retrying():
            with attempt:
                response = await self.stub.ReleaseLease(request, timeout=self.call_timeout_s)
        return response.existed

    @contextlib.asynccontextmanager
    async def lease(
        self,
        image: str,
        *,
        owner: str = "",
        instance_id: str = "",
        request_id: str | None = None,
        wait_s: float = 60.0,
        ttl_s: float | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        spec: pb.SandboxSpec | None = None,
        node_selector: Mapping[str, str] | None = None,
        keepalive_interval_s: float | None = None,
    ) -> AsyncIterator[Lease]:
        """Acquires a lease, keeps it alive while the body runs, releases it on exit."""
        if spec is None and (workdir or env):
            spec = sandbox_spec(workdir=workdir, env=env)
        message = await self.acquire(
            image,
            owner=owner,
            instance_id=instance_id,
            request_id=request_id,
            wait_s=wait_s,
            ttl_s=ttl_s,
            spec=spec,
            node_selector=node_selector,
        )
        ttl = ttl_s or max(1.0, _ts(message.expire_time) - time.time())
        handle = Lease(
            self,
            message,
            ttl_s=ttl_s or 0.0,
            keepalive_interval_s=keepalive_interval_s or min(ttl / 3, 10.0),
        )
        try:
            handle.start_keepalive()
            yield handle
        finally:
            # Shielded: a cancelled body still gives its sandbox back.
            await asyncio.shield(handle.release())

    async def prewarm(
        self, image: str, count: int, spec: pb.SandboxSpec | None = None
    ) -> pb.PrewarmResponse:
        request = pb.PrewarmRequest(
            request_id=uuid.uuid4().hex, image=image, count=count, spec=spec
        )
        return await self.stub.Prewarm(request, timeout=self.call_timeout_s)

    async def list_leases(self, **filters: Any) -> list[pb.Lease]:
        response = await self.stub.ListLeases(
            pb.ListLeasesRequest(**filters), timeout=self.call_timeout_s
        )
        return list(response.leases)

    async def list_nodes(self) -> list[pb.Node]:
        response = await self.stub.ListNodes(pb.ListNodesRequest(), timeout=self.call_timeout_s)
        return list(response.nodes)

    async def register_node(
        self,
        node_id: str,
        address: str,
        *,
        capacity: int = 0,
        labels: Mapping[str, str] | None = None,
    ) -> pb.Node:
        request = pb.RegisterNodeRequest(
            request_id=uuid.uuid4().hex,
            node_id=node_id,
            address=address,
            capacity=capacity,
            labels=dict(labels or {}),
        )
        return (await self.stub.RegisterNode(request, timeout=self.call_timeout_s)).node

    async def drain_node(self, node_id: str, *, evict: bool = False) -> pb.Node:
        request = pb.DrainNodeRequest(request_id=uuid.uuid4().hex, node_id=node_id, evict=evict)
        return (await self.stub.DrainNode(request, timeout=self.call_timeout_s)).node


__all__ = ["Lease", "LeaseLost", "PoolClient", "sandbox_spec"]
