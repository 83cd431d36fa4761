"""Async client of the pool: leases (acquire, keep alive, fork, release), and the pool's nodes
and images as the pool sees them. What the agent service, the exec nodes and the tools use.

    pool = PoolClient("head:18090", token=TOKEN)
    async with pool.lease("swerl-examples/x:latest", owner="agent-3/ep-17") as lease:
        node = SandboxClient.for_lease(lease)               # swerl.exec.client: the node's seam
        result = await node.run(lease.sandbox_id, "git status")
        if lease.lost.is_set(): ...                          # the pool reported the lease lost
    await pool.close()

The lease context renews the lease over one KeepAlive stream in the background (reconnecting
with backoff while the pool restarts, and meanwhile renewing the sandbox on its node directly
through the holder's own connection to it, so a slow pool restart costs no lease), watches for
`lost`, and releases the lease on exit, even when the body is cancelled. Calls are retried only
where idempotent: AcquireLease and ReleaseLease carry a request_id, KeepAlive renewals are
naturally idempotent.

This client speaks only the pool's contract: a lease tells its holder where its sandbox is and
with which token (`Lease.node_address`, `Lease.token`); talking to that node is the exec node's
client's job (swerl.exec.client), which this module never imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Protocol

import grpc
import structlog

from swerl.chassis.bounded import within
from swerl.chassis.client import make_channel
from swerl.chassis.retry import async_retrying
from swerl.chassis.timeconv import duration_pb
from swerl.pool import placement
from swerl.pool.model import NodeState
from swerl.pool.v1 import pool_pb2 as pb
from swerl.pool.v1 import pool_pb2_grpc
from swerl.pool.wire import NODE_STATE_FROM_PB

log = structlog.get_logger("swerl.pool.client")

# The reason a lease was lost, as `PoolLease.lost_reason` and `LeaseLost` name it.
LOSS_REASON_NAMES: dict[pb.LeaseLossReason, str] = {
    pb.LEASE_LOSS_REASON_UNSPECIFIED: "UNSPECIFIED",
    pb.LEASE_LOSS_REASON_RELEASED: "RELEASED",
    pb.LEASE_LOSS_REASON_EXPIRED: "EXPIRED",
    pb.LEASE_LOSS_REASON_NODE_LOST: "NODE_LOST",
    pb.LEASE_LOSS_REASON_SANDBOX_LOST: "SANDBOX_LOST",
    pb.LEASE_LOSS_REASON_REVOKED: "REVOKED",
    pb.LEASE_LOSS_REASON_NOT_FOUND: "NOT_FOUND",
}

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
    spec = pb.SandboxSpec(workdir=workdir or "", env=dict(env or {}), labels=dict(labels or {}))
    # The limits are the exec node's own message (the pool's contract embeds it): set in place.
    spec.resources.SetInParent()
    spec.resources.cpus, spec.resources.memory_bytes, spec.resources.pids = cpus, memory_bytes, pids
    return spec


class NodeConnection(Protocol):
    """A lease holder's own connection to the lease's node (`swerl.exec.client.SandboxClient`,
    made by its `for_lease`, is one). Attached to the lease (`Lease.attach_node`), it is how the
    sandbox stays alive on its node while the pool is away, and it is closed with the lease."""

    async def hold_sandbox(self, sandbox_id: str, hold_s: float) -> float:
        """Keeps the sandbox on the node at least `hold_s` more seconds (never shortening what
        the node has) and returns its expiry there, epoch seconds; NOT_FOUND when the node no
        longer has it."""
        ...

    async def aclose(self) -> None: ...


class Lease:
    """A held lease: where its sandbox is, with which token, and whether it is still alive.

    Its holder reaches the sandbox's node with the node's client (`SandboxClient.for_lease`),
    which attaches itself here: while the pool is away the lease's sandbox is renewed on the
    node through it. A lease no connection is attached to is renewed by the pool alone."""

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
        self.ttl_s = ttl_s
        # What the node is renewed by while the pool is away (ttl_s, or the pool's default).
        self.hold_s = ttl_s or max(1.0, self.expire_time - time.time())
        self.interval_s = keepalive_interval_s
        # The node takes the credentials the pool does (one deployment, one bearer token and CA).
        self.auth_token = pool.token
        self.tls_ca_file = pool.tls_ca_file
        self.node: NodeConnection | None = None
        self.next_renew = 0.0  # monotonic time of its next renewal
        self._released = False

    def attach_node(self, node: NodeConnection) -> None:
        """Makes `node` the lease's connection to its node: the sandbox is renewed through it
        while the pool is away, and it is closed when the lease is released."""
        self.node = node

    def raise_if_lost(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(self.lease_id, self.lost_reason or "UNSPECIFIED", self.lost_message)

    def _set_lost(self, reason: str, message: str) -> None:
        if not self.lost.is_set():
            self.lost_reason, self.lost_message = reason, message
            self.lost.set()
            log.warning("lease.lost", lease_id=self.lease_id, reason=reason, message=message)

    def _apply(self, expiry: pb.KeepAliveExpiry) -> None:
        self.token = expiry.token or self.token
        self.expire_time = _ts(expiry.expire_time)

    async def release(self) -> bool:
        """Releases the lease (idempotent) and closes its node connection."""
        self._pool._keeper.remove(self.lease_id)
        existed = False
        if not self._released:
            self._released = True
            try:
                existed = await self._pool.release(self.lease_id)
            finally:
                if self.node is not None:
                    await self.node.aclose()
        return existed


# What grpc's aio client reports when one of its own operations on a stream fails (a pool killed
# while the client writes a renewal): the stream broke, the pool said nothing.
_BROKEN_STREAM_DETAILS = "Internal error from Core"


def _pool_away(exc: BaseException) -> bool:
    """A KeepAlive stream that ended because the pool is away (or the stream broke): retried."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    return code == grpc.StatusCode.INTERNAL and exc.details() == _BROKEN_STREAM_DETAILS


class _Keeper:
    """One KeepAlive stream for every lease a PoolClient holds.

    Each round it renews the leases that are due in one KeepAliveRenewBatch, and routes
    expiries (fresh tokens) and losses to their Lease objects. While the pool is away
    (UNAVAILABLE) it reconnects with the one backoff policy and renews everything at once on
    reconnect; it never gives a lease up by itself before the nodes would have reaped it.

    A pool that is away renews nothing on the nodes, and a node reaps a sandbox at its own expiry
    whatever the pool's state: a pool restart slower than the TTL (a loaded machine) would cost
    every lease. So while the pool is away the keeper renews each due lease's sandbox on its node
    itself (RenewSandbox, only ever moving the node's expiry later), until a reconnected stream
    answers; the restarted pool then adopts the sandboxes with the expiry the holder kept.
    """

    def __init__(self, pool: PoolClient) -> None:
        self._pool = pool
        self.leases: dict[str, Lease] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._bridge: asyncio.Task[None] | None = None  # Node renewals while the pool is away.

    def add(self, lease: Lease) -> None:
        # Renewed (and so watched for losses) on the stream at once.
        lease.next_renew = time.monotonic()
        self.leases[lease.lease_id] = lease
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pool.keeper")
        self._wake.set()

    def remove(self, lease_id: str) -> None:
        self.leases.pop(lease_id, None)
        self._wake.set()

    async def close(self) -> None:
        self._stop_bridge()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    def _lose(self, lease_id: str, reason: str, message: str) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            lease._set_lost(reason, message)

    async def _run(self) -> None:
        try:
            while self.leases:
                try:
                    async for attempt in async_retrying(
                        max_attempts=_FOREVER,
                        max_delay_s=_FOREVER,
                        max_wait_s=2.0,
                        retry_on=_pool_away,
                    ):
                        with attempt:
                            await self._away_while(self._session())
                except grpc.aio.AioRpcError as err:
                    # Not a pool that is away (that is retried above): refused outright.
                    for lease_id in list(self.leases):
                        self._lose(
                            lease_id,
                            "UNSPECIFIED",
                            f"KeepAlive failed: {err.code().name} {err.details()}",
                        )
                    return
                if self.leases:
                    await asyncio.sleep(0.2)
        finally:
            self._stop_bridge()

    async def _away_while(self, session: Any) -> None:
        """Runs one session; a pool found away starts the renewals on the nodes."""
        try:
            await session
        except grpc.aio.AioRpcError as err:
            if _pool_away(err) and self.leases:
                if self._bridge is None or self._bridge.done():
                    log.warning(
                        "pool.away_renewing_on_nodes",
                        leases=len(self.leases),
                        code=err.code().name,
                        details=err.details(),
                    )
                    self._bridge = asyncio.get_running_loop().create_task(
                        self._renew_on_nodes(), name="pool.keeper.nodes"
                    )
            raise

    def _stop_bridge(self) -> None:
        if self._bridge is not None:
            self._bridge.cancel()
            self._bridge = None

    async def _renew_on_nodes(self) -> None:
        """While the pool is away: keeps each lease's sandbox alive on its node."""
        next_renew: dict[str, float] = {}
        while self.leases:
            now = time.monotonic()
            due = [x for x in self.leases.values() if next_renew.get(x.lease_id, 0.0) <= now]
            for lease in due:
                next_renew[lease.lease_id] = now + lease.interval_s
            await asyncio.gather(*(self._renew_on_node(lease) for lease in due))
            wait = min(next_renew.get(x, now) for x in self.leases) - time.monotonic()
            await asyncio.sleep(max(0.05, wait))

    async def _renew_on_node(self, lease: Lease) -> None:
        node = lease.node
        if node is None:  # Its holder holds no connection to the node: the pool renews it.
            return
        try:
            # Only ever later: the pool may have set the node's expiry further than our TTL.
            node_expire = await node.hold_sandbox(lease.sandbox_id, lease.hold_s)
            # The node keeps the sandbox that long: the lease is not given up before then.
            lease.expire_time = max(lease.expire_time, node_expire)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                self._lose(lease.lease_id, "SANDBOX_LOST", "the node no longer has the sandbox")
            else:  # The node is away too, or refuses: the pool will tell once it is back.
                log.warning("pool.node_renew_failed", lease_id=lease.lease_id, code=err.code().name)

    async def _session(self) -> None:
        """One stream; returns when no lease is left or the pool ended the stream."""
        now, wall = time.monotonic(), time.time()
        for lease in list(self.leases.values()):
            # Past its expiry by far, the nodes have reaped the sandbox whatever the pool says.
            if wall >= lease.expire_time + max(30.0, 2 * lease.ttl_s):
                self._lose(lease.lease_id, "EXPIRED", "not renewed before its expiry")
            lease.next_renew = now  # Renew everything at once on (re)connect.
        if not self.leases:
            return
        call = self._pool.stub.KeepAlive()
        loop = asyncio.get_running_loop()
        writer = loop.create_task(self._write(call))
        reader = loop.create_task(self._read(call))
        try:
            # Whichever ends first ends the session: a writer that stopped (its stream broke)
            # must not leave a reader waiting on a stream that renews nothing.
            done, _ = await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # Raises the stream's error (UNAVAILABLE is retried).
            elif self.leases and (exc := writer.exception()) is not None:
                log.warning("pool.keepalive_write_failed", error=repr(exc))
        finally:
            for task in (writer, reader):
                task.cancel()
            for task in (writer, reader):
                with contextlib.suppress(BaseException):
                    await task
            call.cancel()

    async def _read(self, call: Any) -> None:
        # read() rather than `async for`: the reader is cancelled from outside, and a
        # cancelled async generator of the call would be closed later from another task.
        while (response := await call.read()) is not grpc.aio.EOF:
            self._stop_bridge()  # The pool answers again: it renews on the nodes itself.
            kind = response.WhichOneof("kind")
            if kind == "expiry_batch":
                for expiry in response.expiry_batch.expiries:
                    if (lease := self.leases.get(expiry.lease_id)) is not None:
                        lease._apply(expiry)
            elif kind == "expiry":
                if (lease := self.leases.get(response.expiry.lease_id)) is not None:
                    lease._apply(response.expiry)
            elif kind == "lost":
                self._lose(
                    response.lost.lease_id,
                    LOSS_REASON_NAMES[response.lost.reason],
                    response.lost.message,
                )
            if not self.leases:
                return

    async def _write(self, call: Any) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            while self.leases:
                now = time.monotonic()
                due = [lease for lease in self.leases.values() if lease.next_renew <= now]
                if due:
                    for lease in due:
                        lease.next_renew = now + lease.interval_s
                    await call.write(
                        pb.KeepAliveRequest(
                            renew_batch=pb.KeepAliveRenewBatch(
                                renews=[
                                    pb.KeepAliveRenew(
                                        lease_id=lease.lease_id, ttl=duration_pb(lease.ttl_s)
                                    )
                                    for lease in due
                                ]
                            )
                        )
                    )
                wait = min((x.next_renew for x in self.leases.values()), default=now + 1) - now
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await within(self._wake.wait(), max(0.0, wait))


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
        self._keeper = _Keeper(self)

    async def close(self) -> None:
        await self._keeper.close()
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
        prefer_not_node_ids: Sequence[str] = (),
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
            prefer_not_node_ids=list(prefer_not_node_ids),
        )
        # Bounded by time, not attempts: a pool restart (seconds) must not fail an acquire that
        # may wait wait_s for capacity anyway; five quick attempts were over in ~3 s (the soak's
        # pool SIGKILL ended such episodes INFRA_ERROR LEASE_UNAVAILABLE).
        retrying = async_retrying(max_attempts=1000, max_delay_s=max(30.0, wait_s))
        async for attempt in retrying:
            with attempt:
                response = await self.stub.AcquireLease(request, timeout=wait_s + 60.0)
        return response.lease

    async def fork(
        self,
        lease_id: str,
        count: int,
        *,
        request_id: str | None = None,
        wait_s: float = 60.0,
        ttl_s: float | None = None,
        owner: str = "",
    ) -> pb.ForkLeaseResponse:
        """ForkLease, retried with the same request_id while the pool is unreachable."""
        request = pb.ForkLeaseRequest(
            request_id=request_id or uuid.uuid4().hex,
            lease_id=lease_id,
            count=count,
            ttl=duration_pb(ttl_s or 0.0),
            wait_timeout=duration_pb(wait_s),
            owner=owner,
        )
        async for attempt in async_retrying(max_delay_s=max(30.0, wait_s)):
            with attempt:
                response = await self.stub.ForkLease(request, timeout=wait_s + 120.0)
        return response

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
        prefer_not_node_ids: Sequence[str] = (),
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
            prefer_not_node_ids=prefer_not_node_ids,
        )
        ttl = ttl_s or max(1.0, _ts(message.expire_time) - time.time())
        handle = Lease(
            self,
            message,
            ttl_s=ttl_s or 0.0,
            keepalive_interval_s=keepalive_interval_s or min(ttl / 3, 10.0),
        )
        try:
            self._keeper.add(handle)
            yield handle
        finally:
            # Shielded: a cancelled body still gives its sandbox back.
            await asyncio.shield(handle.release())

    async def fork_leases(
        self,
        source: Lease,
        count: int,
        *,
        request_id: str | None = None,
        wait_s: float = 60.0,
        owner: str = "",
    ) -> list[Lease]:
        """ForkLease of a held lease: `count` new leases on its node, each kept alive like the
        one `lease` yields; the caller releases each (`Lease.release`)."""
        response = await self.fork(
            source.lease_id,
            count,
            request_id=request_id,
            wait_s=wait_s,
            ttl_s=source.ttl_s or None,
            owner=owner,
        )
        handles = [
            Lease(
                self,
                message,
                ttl_s=source.ttl_s,
                keepalive_interval_s=source.interval_s,
            )
            for message in response.leases
        ]
        for handle in handles:
            self._keeper.add(handle)
        return handles

    async def prewarm(
        self, image: str, count: int, spec: pb.SandboxSpec | None = None
    ) -> pb.PrewarmResponse:
        request = pb.PrewarmRequest(
            request_id=uuid.uuid4().hex, image=image, count=count, spec=spec
        )
        return await self.stub.Prewarm(request, timeout=self.call_timeout_s)

    async def prefetch_images(
        self, images: Sequence[str], *, retry: bool = True
    ) -> list[pb.ImagePrefetch]:
        """PrefetchImages: starts pulls of `images` on their home nodes (naturally idempotent,
        so retried while the pool is unreachable). `retry=False`: one attempt, for a caller
        whose next call repeats the advice anyway (the trainer's prefetcher)."""
        request = pb.PrefetchImagesRequest(request_id=uuid.uuid4().hex, images=list(images))
        if not retry:
            response = await self.stub.PrefetchImages(request, timeout=self.call_timeout_s)
            return list(response.images)
        async for attempt in async_retrying():
            with attempt:
                response = await self.stub.PrefetchImages(request, timeout=self.call_timeout_s)
        return list(response.images)

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
        request_id: str | None = None,
    ) -> pb.Node:
        """RegisterNode, one attempt. `request_id`: the same one on every attempt of a caller
        that retries (a node registering at start-up), so the pool answers them as one."""
        request = pb.RegisterNodeRequest(
            request_id=request_id or uuid.uuid4().hex,
            node_id=node_id,
            address=address,
            capacity=capacity,
            labels=dict(labels or {}),
        )
        return (await self.stub.RegisterNode(request, timeout=self.call_timeout_s)).node

    async def drain_node(self, node_id: str, *, evict: bool = False) -> pb.Node:
        request = pb.DrainNodeRequest(request_id=uuid.uuid4().hex, node_id=node_id, evict=evict)
        return (await self.stub.DrainNode(request, timeout=self.call_timeout_s)).node


# -- the pool's own rules, for clients that must agree with the pool --------------------------
# (`swerl images pull --pool --replicas` pre-pulls an image exactly where the pool would.)


def node_state(state: pb.NodeState) -> NodeState:
    """A listed node's state in the pool's own terms. A state this client does not know (a newer
    pool's) is PENDING, which the pool's placement never counts as healthy."""
    return NODE_STATE_FROM_PB.get(state, NodeState.PENDING)


def image_key(image: str) -> str:
    """The name the pool hashes an image under (Docker's RepoTags form: no docker.io/ or
    library/, a tag always)."""
    return placement.image_key(image)


def home_nodes(nodes: Iterable[tuple[str, NodeState]]) -> tuple[str, ...]:
    """The ids of the nodes the pool homes images on, from (node id, state) pairs: the ones it
    counts as healthy."""
    return placement.home_candidates(nodes)


def image_homes(
    images: Iterable[str], home_node_ids: Sequence[str], replicas: int
) -> dict[str, list[str]]:
    """image -> the ids of its `replicas` home nodes among `home_node_ids` (`home_nodes`' answer),
    by the pool's rendezvous hashing, best first."""
    return placement.homes_by_image(images, home_node_ids, replicas)


__all__ = [
    "Lease",
    "LeaseLost",
    "PoolClient",
    "home_nodes",
    "image_homes",
    "image_key",
    "node_state",
    "sandbox_spec",
]
