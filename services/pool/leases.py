"""The pool's domain: one `Pool` that places leases on nodes and keeps them alive.

`Pool` is the front the servicer calls; the work is done by its parts, all around one shared
`PoolState` on one asyncio loop (so no locks: every decision happens between awaits):

  swerl.pool.model      the records: Lease, Node, Spare, Spec and their state enums
  swerl.pool.state      the shared state and the lease lifecycle (the one transition function)
  swerl.pool.placement  where a node is chosen (pure functions over the load index)
  swerl.pool.queue      the FIFO queue of AcquireLease requests and their placement on a node
  swerl.pool.pulls      image pulls on nodes: one per node and image, lease pulls first
  swerl.pool.registry   nodes: registration, health, drain, adoption of what they hold
  swerl.pool.spares     warm spares (Prewarm targets)
  swerl.pool.keepalive  KeepAlive streams, renewals and lease tokens

This module adds what is left: start and stop, release, expiry, prefetch, the maintenance pass
and the listings. Capacity is held by a lease from the moment it is placed on a node until that node
confirms its sandbox destroyed, and by a warm spare from its creation until its destroy is
confirmed. No grpc here: nodes are reached through the `NodeConnection` Protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import structlog

from swerl.chassis.bounded import within
from swerl.chassis.errors import SwerlError
from swerl.pool import placement
from swerl.pool.errors import InvalidLeaseRequest
from swerl.pool.forks import ForkedLeases, ForkLeaseRequest, Forks
from swerl.pool.keepalive import RENEW_SLICE, KeepAlive, Tokens
from swerl.pool.model import (
    ACTIVE,
    ENDED,
    LABEL_REQUEST,
    LABEL_SPARE,
    LABEL_SPEC,
    LABEL_TTL,
    PENDING,
    PULLING,
    RELEASING,
    SPARE_OWNER,
    AcquireRequest,
    Expiry,
    ExpiryBatch,
    Lease,
    LeaseState,
    LoadIndex,
    LossReason,
    Lost,
    Node,
    NodeState,
    Spare,
    Spec,
    Target,
    Watcher,
    image_names,
)
from swerl.pool.nodes import NodeConnection
from swerl.pool.pulls import Pull, PullPriority, Pulls
from swerl.pool.queue import RETRY_DELAY_S, Queue
from swerl.pool.registry import NodeRegistry, parse_static_node
from swerl.pool.settings import PoolSettings
from swerl.pool.spares import Spares
from swerl.pool.state import PoolState
from swerl.pool.store import PoolStore

__all__ = [
    "ACTIVE",
    "ENDED",
    "LABEL_REQUEST",
    "LABEL_SPARE",
    "LABEL_SPEC",
    "LABEL_TTL",
    "N_DRAINED",
    "N_DRAINING",
    "N_HEALTHY",
    "N_PENDING",
    "N_UNHEALTHY",
    "PENDING",
    "PULLING",
    "RELEASING",
    "RENEW_SLICE",
    "RETRY_DELAY_S",
    "SPARE_OWNER",
    "AcquireRequest",
    "Expiry",
    "ExpiryBatch",
    "Lease",
    "LeaseState",
    "LoadIndex",
    "LossReason",
    "Lost",
    "Node",
    "NodeState",
    "Pool",
    "Prefetch",
    "Pull",
    "Spare",
    "Spec",
    "Target",
    "Watcher",
    "image_names",
    "parse_static_node",
]

log = structlog.get_logger("swerl.pool")

N_PENDING, N_HEALTHY, N_UNHEALTHY, N_DRAINING, N_DRAINED = (
    NodeState.PENDING,
    NodeState.HEALTHY,
    NodeState.UNHEALTHY,
    NodeState.DRAINING,
    NodeState.DRAINED,
)


# What PrefetchImages did with one image: STARTED (pulling, or joined a pull), PRESENT (a home
# has it), FAILED (a recent pull failed), SKIPPED (no pulls, or no healthy home). The servicer's
# table maps each to the contract's PrefetchStatus (a test checks both sides).
PrefetchStatus = Literal["STARTED", "PRESENT", "FAILED", "SKIPPED"]
PREFETCH_STATUSES: tuple[PrefetchStatus, ...] = get_args(PrefetchStatus)


@dataclass(frozen=True)
class Prefetch:
    """What PrefetchImages did with one image."""

    image: str
    homes: list[str]
    status: PrefetchStatus
    message: str = ""
    reason: str = ""
    node_id: str = ""


class Pool:
    def __init__(
        self,
        settings: PoolSettings,
        connect: Callable[[str], NodeConnection],
        store: PoolStore | None = None,
    ) -> None:
        self.settings = settings
        self._state = state = PoolState(settings)
        tokens = Tokens(settings)
        self._pulls = Pulls(state, self._refresh_images)
        self._requests = Queue(state, tokens, self._pulls)
        self._keepalive = KeepAlive(state, tokens)
        self._spares = Spares(state, store)
        self._registry = NodeRegistry(state, connect, store, tokens, self._spares)
        self._forks = Forks(state, tokens)
        self.nodes = state.nodes
        self.leases = state.leases
        self.targets = state.targets
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    @property
    def _queue(self) -> list[Lease]:
        """The requests waiting for room, oldest first."""
        return self._state.queue

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._spares.load_targets()
        await self._registry.load()
        self._tasks = [
            loop.create_task(self._expiry_loop(), name="pool.expiry"),
            loop.create_task(self._maintenance_loop(), name="pool.maintenance"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        tasks: list[asyncio.Task[Any]] = [*self._tasks, *self._state.background]
        tasks += self._registry.health_tasks()
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded all the same (a loop's awaits go through swerl.chassis.bounded, which keeps
            # a cancel); the loops also stop on _stopping.
            await asyncio.wait(tasks, timeout=5.0)
        await self._registry.close()
        waiting = [*self._state.queue]
        waiting += [x for x in self._state.leases.values() if x.state is PULLING]
        for lease in waiting:
            if lease.ready is not None and not lease.ready.done():
                lease.ready.cancel()

    # -- nodes ----------------------------------------------------------------------------
    async def register_node(
        self, node_id: str, address: str, capacity: int, labels: Mapping[str, str]
    ) -> Node:
        return await self._registry.register(node_id, address, capacity, labels)

    async def drain_node(self, node_id: str, evict: bool) -> Node:
        return await self._registry.drain(node_id, evict)

    # -- leases ---------------------------------------------------------------------------
    async def acquire(self, request: AcquireRequest) -> Lease:
        return await self._requests.acquire(request)

    async def fork(self, request: ForkLeaseRequest) -> ForkedLeases:
        return await self._forks.fork(request)

    async def release(self, lease_id: str) -> tuple[bool, Lease | None]:
        state = self._state
        lease = state.leases.get(lease_id)
        if lease is None or lease.state is ENDED:
            return False, lease
        if lease.state is PULLING:  # Its room is given back now; the pull goes on.
            state.transition(lease, ENDED, reason=LossReason.RELEASED)
            return True, lease
        if lease.state is PENDING:
            # Queued: it ends now. Being placed: the placement destroys its sandbox once made.
            queued = lease in state.queue
            state.transition(lease, ENDED if queued else RELEASING, reason=LossReason.RELEASED)
            return True, lease
        if lease.state is ACTIVE:
            state.end(lease, LossReason.RELEASED, "released")
        if lease.destroying is not None:
            # Bounded: a node that hangs leaves the lease RELEASING (retried in the background).
            await asyncio.wait([lease.destroying], timeout=self.settings.release_wait_s)
        return True, lease

    # -- keepalive ------------------------------------------------------------------------
    def open_watcher(self) -> Watcher:
        return self._keepalive.open_watcher()

    def close_watcher(self, watcher: Watcher) -> None:
        self._keepalive.close_watcher(watcher)

    def watch(self, watcher: Watcher, lease_id: str) -> Lease | None:
        return self._keepalive.watch(watcher, lease_id)

    async def renew(self, watcher: Watcher, lease_id: str, ttl_s: float) -> None:
        await self._keepalive.renew(watcher, lease_id, ttl_s)

    async def renew_batch(self, watcher: Watcher, renewals: Iterable[tuple[str, float]]) -> None:
        await self._keepalive.renew_batch(watcher, renewals)

    # -- warm spares ----------------------------------------------------------------------
    def prewarm(self, image: str, count: int, spec: Spec) -> tuple[int, int]:
        return self._spares.prewarm(image, count, spec)

    def spare_counts(self, image: str, key: str) -> tuple[int, int]:
        return self._spares.counts(image, key)

    # -- images ---------------------------------------------------------------------------
    def prefetch(self, images: Iterable[str]) -> list[Prefetch]:
        """Starts pulls of `images` on their best home node, behind every pull a lease waits
        on; an image that a home has (or is pulling) already needs nothing."""
        out: list[Prefetch] = []
        for image in dict.fromkeys(images):
            if not image:
                raise InvalidLeaseRequest("an image name is empty")
            homes = self._pulls.homes_of(image)
            pulling = self._pulls.pulling_on(image)
            if not self.settings.pull:
                out.append(Prefetch(image, homes, "SKIPPED", "the pool does not pull (--no-pull)"))
                continue
            node = placement.prefetch_node(image, homes, self._state.nodes, pulling)
            if node is not None:
                try:
                    self._pulls.check(image)
                except SwerlError as exc:  # A recent failure: say so, start nothing.
                    out.append(Prefetch(image, homes, "FAILED", exc.message, exc.reason))
                    continue
                self._pulls.start(node, image, PullPriority.PREFETCH)
                out.append(Prefetch(image, homes, "STARTED", node_id=node.node_id))
                continue
            where = next(
                (n for n in homes if n in self.nodes and self.nodes[n].has_image(image)), ""
            )
            if where:
                out.append(Prefetch(image, homes, "PRESENT", node_id=where))
            elif pulling:
                out.append(Prefetch(image, homes, "STARTED", node_id=next(iter(pulling))))
            else:
                out.append(Prefetch(image, homes, "SKIPPED", "no healthy home node"))
        return out

    def pulls(self) -> list[Pull]:
        return self._pulls.pulls()

    def pulls_in_flight(self) -> dict[str, int]:
        """Pulls running or waiting to run, per node id."""
        counts: dict[str, int] = {}
        for pull in self._pulls.pulls():
            counts[pull.node_id] = counts.get(pull.node_id, 0) + 1
        return counts

    def _refresh_images(self, node: Node) -> None:
        self._state.spawn(self._registry.refresh_images(node))

    # -- expiry and maintenance -----------------------------------------------------------
    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.expiry_interval_s)
            self._expire_due(time.time())

    def _expire_due(self, now: float) -> None:
        """Ends the ACTIVE leases whose expiry has passed. Only heap entries that came due are
        looked at: an expiry only ever moves later, so an entry is never later than its lease's
        expiry; one whose lease was renewed meanwhile is pushed again at the current expiry."""
        state = self._state
        heap, active = state.expiries, state.active
        while heap and heap[0][0] <= now:
            _, seq, lease_id = heapq.heappop(heap)
            lease = active.get(lease_id)
            if lease is None or lease.expiry_seq != seq:
                continue  # Ended already, or a stale entry of a lease adopted under its id.
            if lease.expire_time <= now:
                state.end(lease, LossReason.EXPIRED, "not renewed before its expiry")
            else:
                state.push_expiry(lease)

    async def _maintenance_loop(self) -> None:
        state = self._state
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await within(state.maintain_now.wait(), self.settings.maintenance_interval_s)
            state.maintain_now.clear()
            try:
                self._maintain()
            except Exception:
                log.exception("pool.maintenance_error")

    def _maintain(self) -> None:
        """Retries destroys, drops old ENDED leases, forgets the nodes queued requests avoid,
        refreshes image lists, tends the spares, and places what fits."""
        state = self._state
        now = time.time()
        for lease in list(state.releasing.values()):
            if lease.state is not RELEASING:
                del state.releasing[lease.lease_id]
            elif lease.sandbox_id:
                node = state.nodes.get(lease.node_id)
                if node is not None and node.state is not N_UNHEALTHY:
                    state.start_destroy(lease)
        ended = state.ended
        while ended and now - ended[0].ended_time > self.settings.ended_retention_s:
            lease = ended.popleft()
            if lease.state is ENDED and state.leases.get(lease.lease_id) is lease:
                del state.leases[lease.lease_id]
        for lease in state.queue:
            lease.avoid.clear()
        for node in state.nodes.values():
            if node.state is N_HEALTHY and now - node.images_time > (
                self.settings.image_refresh_interval_s
            ):
                node.images_time = now
                state.spawn(self._registry.refresh_images(node))
        self._spares.tend()
        state.pump()

    # -- queries --------------------------------------------------------------------------
    def list_leases(
        self,
        *,
        owner: str = "",
        node_id: str = "",
        instance_id: str = "",
        image: str = "",
        states: Iterable[LeaseState] = (),
    ) -> list[Lease]:
        wanted = set(states) or {PENDING, PULLING, ACTIVE, RELEASING}
        rows = [
            lease
            for lease in self.leases.values()
            if lease.state in wanted
            and (not owner or lease.owner == owner)
            and (not node_id or lease.node_id == node_id)
            and (not instance_id or lease.instance_id == instance_id)
            and (not image or lease.image == image)
        ]
        return sorted(rows, key=lambda lease: lease.create_time)

    def list_nodes(self, states: Iterable[NodeState] = ()) -> list[Node]:
        wanted = set(states)
        return [n for n in self.nodes.values() if not wanted or n.state in wanted]
