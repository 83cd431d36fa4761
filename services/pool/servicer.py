"""PoolService: protos in, the Pool's domain calls, protos out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from swerl.chassis.timeconv import duration_pb, seconds_of, timestamp_pb
from swerl.pool.forks import ForkLeaseRequest
from swerl.pool.leases import Pool, Prefetch
from swerl.pool.model import AcquireRequest as DomainAcquire
from swerl.pool.model import (
    Expiry,
    ExpiryBatch,
    Lease,
    Lost,
    Node,
    Spec,
    Watcher,
)
from swerl.pool.pulls import Pull, PullPriority
from swerl.pool.v1 import pool_pb2 as pb
from swerl.pool.v1 import pool_pb2_grpc
from swerl.pool.wire import (
    LEASE_STATE_FROM_PB,
    LEASE_STATE_TO_PB,
    LOSS_REASON_TO_PB,
    NODE_STATE_FROM_PB,
    NODE_STATE_TO_PB,
    PREFETCH_STATUS_TO_PB,
)


def spec_from_pb(spec: pb.SandboxSpec) -> Spec:
    return Spec(
        workdir=spec.workdir,
        env=dict(spec.env),
        cpus=spec.resources.cpus,
        memory_bytes=spec.resources.memory_bytes,
        pids=spec.resources.pids,
        network=spec.network,
        labels=dict(spec.labels),
    )


def lease_to_pb(lease: Lease, *, with_token: bool) -> pb.Lease:
    message = pb.Lease(
        lease_id=lease.lease_id,
        node_id=lease.node_id,
        node_address=lease.node_address,
        sandbox_id=lease.sandbox_id,
        token=lease.token if with_token else "",
        image=lease.image,
        instance_id=lease.instance_id,
        owner=lease.owner,
        create_time=timestamp_pb(lease.create_time),
        state=LEASE_STATE_TO_PB[lease.state],
        from_warm_spare=lease.from_warm_spare,
        wait_duration=duration_pb(lease.wait_duration_s),
    )
    if lease.expire_time:
        message.expire_time.CopyFrom(timestamp_pb(lease.expire_time))
    if lease.loss_reason:
        message.loss_reason = LOSS_REASON_TO_PB[lease.loss_reason]
    if lease.pull_duration_s:
        message.pull_duration.CopyFrom(duration_pb(lease.pull_duration_s))
    if lease.pull is not None:
        message.pull.CopyFrom(pull_to_pb(lease.pull))
    return message


def pull_to_pb(pull: Pull) -> pb.ImagePull:
    message = pb.ImagePull(
        image=pull.image,
        node_id=pull.node_id,
        status=pull.status,
        current_bytes=pull.current_bytes,
        total_bytes=pull.total_bytes,
        queue_time=timestamp_pb(pull.queued_time),
        for_lease=pull.priority is PullPriority.LEASE,
    )
    if pull.start_time:
        message.start_time.CopyFrom(timestamp_pb(pull.start_time))
    return message


def prefetch_to_pb(prefetch: Prefetch) -> pb.ImagePrefetch:
    return pb.ImagePrefetch(
        image=prefetch.image,
        status=PREFETCH_STATUS_TO_PB[prefetch.status],
        home_node_ids=prefetch.homes,
        node_id=prefetch.node_id,
        reason=prefetch.reason,
        message=prefetch.message,
    )


def node_to_pb(node: Node, pulls_in_flight: int = 0) -> pb.Node:
    message = pb.Node(
        node_id=node.node_id,
        address=node.address,
        state=NODE_STATE_TO_PB[node.state],
        capacity=node.capacity,
        lease_count=len(node.leases),
        warm_spare_count=sum(1 for s in node.spares.values() if s.ready and not s.destroying),
        image_count=len(node.images),
        labels=node.labels,
        version=node.version,
        register_time=timestamp_pb(node.register_time),
        health_message=node.health_message,
        consecutive_failures=node.failures,
        image_budget_bytes=node.image_budget_bytes,
        image_used_bytes=node.image_used_bytes,
        image_hits=node.image_hits,
        image_misses=node.image_misses,
        image_pulls=node.image_pulls,
        pulls_in_flight=pulls_in_flight,
    )
    if node.last_seen:
        message.last_seen_time.CopyFrom(timestamp_pb(node.last_seen))
    return message


def _expiry_to_pb(event: Expiry) -> pb.KeepAliveExpiry:
    return pb.KeepAliveExpiry(
        lease_id=event.lease_id, expire_time=timestamp_pb(event.expire_time), token=event.token
    )


def _expiry_batch_to_pb(batch: ExpiryBatch) -> pb.KeepAliveResponse:
    # Filled in place (no Timestamp built and copied per entry): at scale this runs for 20,000
    # renewals a second on the pool's loop.
    response = pb.KeepAliveResponse()
    expiries = response.expiry_batch
    expiries.SetInParent()
    add = expiries.expiries.add
    for event in batch.expiries:
        seconds, nanos = divmod(int(event.expire_time * 1e9), 1_000_000_000)
        add(
            lease_id=event.lease_id,
            expire_time={"seconds": seconds, "nanos": nanos},
            token=event.token,
        )
    return response


def _event_to_pb(event: Expiry | ExpiryBatch | Lost) -> pb.KeepAliveResponse:
    if isinstance(event, ExpiryBatch):
        return _expiry_batch_to_pb(event)
    if isinstance(event, Expiry):
        return pb.KeepAliveResponse(expiry=_expiry_to_pb(event))
    return pb.KeepAliveResponse(
        lost=pb.LeaseLost(
            lease_id=event.lease_id,
            reason=LOSS_REASON_TO_PB[event.reason],
            message=event.message,
        )
    )


class PoolServicer(pool_pb2_grpc.PoolServiceServicer):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    async def AcquireLease(
        self, request: pb.AcquireLeaseRequest, context
    ) -> pb.AcquireLeaseResponse:
        lease = await self._pool.acquire(
            DomainAcquire(
                image=request.image,
                request_id=request.request_id,
                instance_id=request.instance_id,
                owner=request.owner,
                ttl_s=seconds_of(request.ttl),
                wait_s=seconds_of(request.wait_timeout),
                spec=spec_from_pb(request.spec),
                node_selector=dict(request.node_selector),
                prefer_not=frozenset(request.prefer_not_node_ids),
            )
        )
        return pb.AcquireLeaseResponse(lease=lease_to_pb(lease, with_token=True))

    async def ForkLease(self, request: pb.ForkLeaseRequest, context) -> pb.ForkLeaseResponse:
        forked = await self._pool.fork(
            ForkLeaseRequest(
                lease_id=request.lease_id,
                count=request.count,
                request_id=request.request_id,
                ttl_s=seconds_of(request.ttl),
                wait_s=seconds_of(request.wait_timeout),
                owner=request.owner,
            )
        )
        return pb.ForkLeaseResponse(
            leases=[lease_to_pb(lease, with_token=True) for lease in forked.leases],
            checkpoint_id=forked.checkpoint_id,
        )

    async def KeepAlive(
        self, request_iterator: AsyncIterator[pb.KeepAliveRequest], context
    ) -> AsyncIterator[pb.KeepAliveResponse]:
        watcher = self._pool.open_watcher()
        reader = asyncio.get_running_loop().create_task(self._read(request_iterator, watcher))
        try:
            while True:
                event = await watcher.events.get()
                if event is None:
                    return
                response = _event_to_pb(event)
                # Not kept while the next event is awaited (a second, at 1 Hz): a batch that
                # lives that long is promoted by the garbage collector, and promoting 20,000
                # expiries a second triggered full collections of the whole lease table.
                del event
                yield response
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            self._pool.close_watcher(watcher)

    async def _read(self, requests: AsyncIterator[pb.KeepAliveRequest], watcher: Watcher) -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "watch":
                    self._pool.watch(watcher, request.watch.lease_id)
                elif kind == "renew":
                    await self._pool.renew(
                        watcher, request.renew.lease_id, seconds_of(request.renew.ttl)
                    )
                elif kind == "renew_batch":
                    await self._pool.renew_batch(
                        watcher,
                        [(r.lease_id, seconds_of(r.ttl)) for r in request.renew_batch.renews],
                    )
        finally:
            watcher.events.put_nowait(None)  # The holder closed its side: end the stream.

    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context
    ) -> pb.ReleaseLeaseResponse:
        existed, lease = await self._pool.release(request.lease_id)
        response = pb.ReleaseLeaseResponse(existed=existed)
        if existed and lease is not None:
            response.lease.CopyFrom(lease_to_pb(lease, with_token=False))
        return response

    async def Prewarm(self, request: pb.PrewarmRequest, context) -> pb.PrewarmResponse:
        ready, pending = self._pool.prewarm(
            request.image, request.count, spec_from_pb(request.spec)
        )
        return pb.PrewarmResponse(ready=ready, pending=pending)

    async def ListLeases(self, request: pb.ListLeasesRequest, context) -> pb.ListLeasesResponse:
        leases = self._pool.list_leases(
            owner=request.owner,
            node_id=request.node_id,
            instance_id=request.instance_id,
            image=request.image,
            states=[
                LEASE_STATE_FROM_PB[s] for s in request.states if s != pb.LEASE_STATE_UNSPECIFIED
            ],
        )
        return pb.ListLeasesResponse(leases=[lease_to_pb(x, with_token=False) for x in leases])

    async def ListNodes(self, request: pb.ListNodesRequest, context) -> pb.ListNodesResponse:
        nodes = self._pool.list_nodes(
            [NODE_STATE_FROM_PB[s] for s in request.states if s != pb.NODE_STATE_UNSPECIFIED]
        )
        in_flight = self._pool.pulls_in_flight()
        return pb.ListNodesResponse(
            nodes=[node_to_pb(n, in_flight.get(n.node_id, 0)) for n in nodes]
        )

    async def RegisterNode(
        self, request: pb.RegisterNodeRequest, context
    ) -> pb.RegisterNodeResponse:
        node = await self._pool.register_node(
            request.node_id, request.address, request.capacity, dict(request.labels)
        )
        return pb.RegisterNodeResponse(node=node_to_pb(node))

    async def DrainNode(self, request: pb.DrainNodeRequest, context) -> pb.DrainNodeResponse:
        node = await self._pool.drain_node(request.node_id, request.evict)
        return pb.DrainNodeResponse(node=node_to_pb(node))

    async def PrefetchImages(
        self, request: pb.PrefetchImagesRequest, context
    ) -> pb.PrefetchImagesResponse:
        done = self._pool.prefetch(request.images)
        return pb.PrefetchImagesResponse(images=[prefetch_to_pb(p) for p in done])
