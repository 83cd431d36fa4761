"""The pool's domain: nodes, leases, the FIFO queue, warm spares, expiry and reconciliation.

One `Pool` object on one asyncio loop owns all state, so no locks: every decision (placing a
queued request, counting capacity) happens between awaits. Capacity is held by a lease from the
moment it is placed on a node until that node confirms its sandbox destroyed, and by a warm spare
from its creation until its destroy is confirmed. The nodes' labelled sandboxes are the truth:
whenever a node is (re)synced, the pool adopts what it finds there and ends what it does not,
which is also how a restarted pool rebuilds its lease table. No grpc here: nodes are reached
through the `NodeConnection` Protocol.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import heapq
import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import structlog

from swerl.chassis import capability
from swerl.chassis.errors import Internal, SwerlError
from swerl.pool import metrics
from swerl.pool.errors import (
    ImageNotPresent,
    InvalidLeaseRequest,
    InvalidNode,
    LeaseCancelled,
    NodeFull,
    NodeIdMismatch,
    NodeImageMissing,
    NodeNotFound,
    NodeRejected,
    NodeSandboxGone,
    NodeUnreachable,
    PoolAtCapacity,
)
from swerl.pool.nodes import CreateRequest, NodeConnection, SandboxFacts
from swerl.pool.settings import PoolSettings
from swerl.pool.store import PoolStore, StoredNode, StoredTarget

log = structlog.get_logger("swerl.pool")

# Lease states and loss reasons (the names of the proto enums without their prefixes).
PENDING, ACTIVE, RELEASING, ENDED = "PENDING", "ACTIVE", "RELEASING", "ENDED"
RELEASED, EXPIRED, NODE_LOST, SANDBOX_LOST, REVOKED, NOT_FOUND = (
    "RELEASED",
    "EXPIRED",
    "NODE_LOST",
    "SANDBOX_LOST",
    "REVOKED",
    "NOT_FOUND",
)
# Node states.
N_PENDING, N_HEALTHY, N_UNHEALTHY, N_DRAINING, N_DRAINED = (
    "PENDING",
    "HEALTHY",
    "UNHEALTHY",
    "DRAINING",
    "DRAINED",
)

# Caller labels the pool writes on its sandboxes, so a restarted pool can read them back.
LABEL_SPARE = "pool.spare"  # spare id, on warm spares
LABEL_SPEC = "pool.spec"  # spec key, on warm spares
LABEL_TTL = "pool.ttl_s"  # the lease's ttl
LABEL_REQUEST = "pool.request_id"  # the AcquireLease request_id

SPARE_OWNER = "swerl-pool/spare"
RETRY_DELAY_S = 1.0
# A renewal batch yields to the loop after this many leases, so an AcquireLease arriving behind
# a holder that renews thousands of leases at once waits for one slice, not the whole batch.
RENEW_SLICE = 256


@dataclass
class Spec:
    """Sandbox settings of a lease or a spare (SandboxSpec)."""

    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    cpus: float = 0.0
    memory_bytes: int = 0
    pids: int = 0
    network: int = 0
    labels: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "workdir": self.workdir,
            "env": dict(sorted(self.env.items())),
            "cpus": self.cpus,
            "memory_bytes": self.memory_bytes,
            "pids": self.pids,
            "network": self.network,
            "labels": dict(sorted(self.labels.items())),
        }

    def key(self) -> str:
        """Equal specs, equal keys: a spare serves a request only when the keys match."""
        text = json.dumps(self.as_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class AcquireRequest:
    image: str
    request_id: str = ""
    instance_id: str = ""
    owner: str = ""
    ttl_s: float = 0.0
    wait_s: float = 0.0
    spec: Spec = field(default_factory=Spec)
    node_selector: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class Lease:
    # Slots: 20,000 of these at scale, each otherwise with its own attribute dict (it has too
    # many fields for Python to share the dict's keys between instances).
    lease_id: str
    request_id: str
    image: str
    instance_id: str
    owner: str
    ttl_s: float
    spec: Spec
    spec_key: str
    node_selector: dict[str, str]
    create_time: float
    state: str = PENDING
    node_id: str = ""
    node_address: str = ""
    sandbox_id: str = ""
    token: str = ""
    expire_time: float = 0.0
    # The expiry written into the token: at least token_grace_s past expire_time.
    token_expire_time: float = 0.0
    expiry_seq: int = -1  # its entry in the pool's expiry heap
    # What the node enforces; kept ahead of expire_time by the slack, renewed lazily.
    node_expire_time: float = 0.0
    loss_reason: str = ""
    loss_message: str = ""
    from_warm_spare: bool = False
    wait_duration_s: float = 0.0
    ended_time: float = 0.0
    ready: asyncio.Future[Lease] | None = None
    waiters: int = 0
    # Set once a caller has received the lease (an AcquireLease answer or a KeepAlive watch);
    # an unclaimed lease whose callers all went away is released after a grace period.
    claimed: bool = False
    avoid: set[str] = field(default_factory=set)
    watchers: set[Watcher] = field(default_factory=set)
    destroying: asyncio.Task[None] | None = None


@dataclass(eq=False)
class Spare:
    spare_id: str
    node_id: str
    image: str
    spec_key: str
    sandbox_id: str = ""
    expire_time: float = 0.0
    ready: bool = False
    destroying: bool = False
    busy: bool = False  # a create, renew or destroy call is in flight


@dataclass
class Target:
    image: str
    spec: Spec
    count: int


@dataclass(eq=False)
class Node:
    node_id: str
    address: str
    conn: NodeConnection
    asked_capacity: int
    labels: dict[str, str]
    register_time: float
    state: str = N_PENDING
    node_capacity: int = 0
    images: set[str] = field(default_factory=set)
    images_time: float = 0.0
    leases: set[str] = field(default_factory=set)
    spares: dict[str, Spare] = field(default_factory=dict)
    version: str = ""
    last_seen: float = 0.0
    health_message: str = ""
    failures: int = 0
    lost: bool = False  # failures reached the threshold; leases were reported lost
    health_task: asyncio.Task[None] | None = None
    sync_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    index: LoadIndex | None = None

    # Every change of what holds capacity goes through these four, which keep the index.
    def hold(self, lease_id: str) -> None:
        before = self.used
        self.leases.add(lease_id)
        self._moved(before)

    def unhold(self, lease_id: str) -> None:
        before = self.used
        self.leases.discard(lease_id)
        self._moved(before)

    def put_spare(self, spare: Spare) -> None:
        before = self.used
        self.spares[spare.spare_id] = spare
        if self.index is not None:
            self.index.spares.setdefault((spare.image, spare.spec_key), {})[spare.spare_id] = spare
        self._moved(before)

    def pop_spare(self, spare_id: str) -> Spare | None:
        before = self.used
        spare = self.spares.pop(spare_id, None)
        if spare is not None and self.index is not None:
            self.index.spares.get((spare.image, spare.spec_key), {}).pop(spare_id, None)
        self._moved(before)
        return spare

    def _moved(self, before: int) -> None:
        if self.index is not None:
            self.index.move(self, before, self.used)

    @property
    def capacity(self) -> int:
        if self.asked_capacity and self.node_capacity:
            return min(self.asked_capacity, self.node_capacity)
        return self.asked_capacity or self.node_capacity

    @property
    def used(self) -> int:
        return len(self.leases) + len(self.spares)

    def has_image(self, image: str) -> bool:
        return any(name in self.images for name in image_names(image))

    def matches(self, selector: Mapping[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in selector.items())


class LoadIndex:
    """Nodes bucketed by how many sandboxes they hold, and spares by (image, spec key), so
    placement looks at the least loaded nodes first instead of scanning a thousand."""

    def __init__(self) -> None:
        self.buckets: dict[int, dict[str, Node]] = {}
        self.spares: dict[tuple[str, str], dict[str, Spare]] = {}

    def add(self, node: Node) -> None:
        node.index = self
        self.buckets.setdefault(node.used, {})[node.node_id] = node

    def move(self, node: Node, before: int, after: int) -> None:
        if before == after:
            return
        bucket = self.buckets.get(before)
        if bucket is not None:
            bucket.pop(node.node_id, None)
            if not bucket:
                del self.buckets[before]
        self.buckets.setdefault(after, {})[node.node_id] = node

    def by_load(self) -> Iterable[tuple[int, Node]]:
        for used in sorted(self.buckets):
            for node in list(self.buckets.get(used, {}).values()):
                yield used, node


class Expiry(NamedTuple):
    # A tuple, not a dataclass: one is made per renewal, 20,000 a second at scale.
    lease_id: str
    expire_time: float
    token: str


@dataclass(frozen=True)
class ExpiryBatch:
    expiries: list[Expiry]


@dataclass(frozen=True)
class Lost:
    lease_id: str
    reason: str
    message: str


class Watcher:
    """One KeepAlive stream: the leases it watches and the events to send it."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[Expiry | ExpiryBatch | Lost | None] = asyncio.Queue()
        self.leases: set[str] = set()


@functools.lru_cache(maxsize=4096)
def image_names(image: str) -> tuple[str, ...]:
    """The names a present image may be listed under ("x" is "x:latest")."""
    last = image.rsplit("/", 1)[-1]
    if "@" in image or ":" in last or image.startswith("sha256:"):
        return (image,)
    return (image, image + ":latest")


def parse_static_node(text: str) -> tuple[str, str]:
    """ "node_id=host:port" -> (node_id, address); a bare address has no id yet ("")."""
    node_id, sep, address = text.partition("=")
    return (node_id.strip(), address.strip()) if sep else ("", text.strip())


class Pool:
    def __init__(
        self,
        settings: PoolSettings,
        connect: Callable[[str], NodeConnection],
        store: PoolStore | None = None,
    ) -> None:
        self.settings = settings
        self._connect = connect
        self._store = store
        secret = settings.capability_secret
        self._secret = secret.get_secret_value().encode() if secret else None
        self.nodes: dict[str, Node] = {}
        self._index = LoadIndex()
        self.leases: dict[str, Lease] = {}
        self._by_request: dict[str, Lease] = {}
        self._queue: list[Lease] = []
        self._active: dict[str, Lease] = {}
        # What the periodic loops look at, so that none of them walks every lease: a heap of
        # (expiry, seq, lease_id) with one entry per ACTIVE lease (renewals do not touch it: an
        # entry that comes due early is pushed again at the lease's current expiry; entries hold
        # no objects, so the garbage collector does not track them), leases RELEASING (destroys
        # to retry), and ENDED leases oldest first (kept for ListLeases).
        self._expiries: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._releasing: dict[str, Lease] = {}
        self._ended: collections.deque[Lease] = collections.deque()
        self.targets: dict[tuple[str, str], Target] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task] = set()
        self._maintain_now = asyncio.Event()
        self._stopping = False

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._store is not None:
            for row in self._store.targets():
                spec = Spec(**row.spec)
                self.targets[(row.image, row.spec_key)] = Target(row.image, spec, row.count)
            for stored in self._store.nodes():
                node = self._add_node(
                    stored.node_id, stored.address, stored.capacity, stored.labels
                )
                if stored.drained:
                    node.state = N_DRAINING
        for text in self.settings.nodes:
            node_id, address = parse_static_node(text)
            if node_id and node_id not in self.nodes:
                self._add_node(node_id, address, 0, {})
            elif not node_id:
                self._spawn(self._register_static(address))
        # Known nodes are synced before the pool answers anyone: a holder renewing right after
        # a restart must find its lease adopted, not be told it does not exist.
        await self._initial_sync()
        self._tasks = [
            loop.create_task(self._expiry_loop(), name="pool.expiry"),
            loop.create_task(self._maintenance_loop(), name="pool.maintenance"),
        ]

    async def _initial_sync(self) -> None:
        async def one(node: Node) -> None:
            try:
                await self._sync(node)
            except Exception as exc:  # Down or refusing: its health loop keeps trying.
                log.warning("pool.initial_sync_failed", node_id=node.node_id, error=str(exc))

        nodes = [n for n in self.nodes.values() if n.state not in (N_DRAINED,)]
        if nodes:
            await asyncio.wait(
                [asyncio.ensure_future(one(n)) for n in nodes],
                timeout=self.settings.initial_sync_timeout_s,
            )

    async def stop(self) -> None:
        self._stopping = True
        tasks = [*self._tasks, *self._background]
        tasks += [n.health_task for n in self.nodes.values() if n.health_task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: asyncio.wait_for in Python < 3.12 can swallow a cancellation that races
            # its inner future; the loops also stop on _stopping.
            await asyncio.wait(tasks, timeout=5.0)
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                await node.conn.close()
        for lease in self._queue:
            if lease.ready is not None and not lease.ready.done():
                lease.ready.cancel()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- nodes ----------------------------------------------------------------------------
    def _add_node(
        self,
        node_id: str,
        address: str,
        capacity: int,
        labels: dict,
        conn: NodeConnection | None = None,
    ) -> Node:
        node = Node(
            node_id=node_id,
            address=address,
            conn=conn or self._connect(address),
            asked_capacity=capacity,
            labels=dict(labels),
            register_time=time.time(),
        )
        self.nodes[node_id] = node
        self._index.add(node)
        node.health_task = asyncio.get_running_loop().create_task(
            self._health_loop(node), name=f"pool.health.{node_id}"
        )
        self._update_node_metrics()
        return node

    async def _register_static(self, address: str) -> None:
        """A static node given without its id: ask it, until it answers."""
        conn = self._connect(address)
        try:
            while True:
                try:
                    facts = await conn.info()
                    break
                except NodeUnreachable:
                    await asyncio.sleep(self.settings.health_retry_interval_s * 4)
        finally:
            await conn.close()
        if facts.node_id not in self.nodes:
            self._add_node(facts.node_id, address, 0, {})

    async def register_node(
        self, node_id: str, address: str, capacity: int, labels: Mapping[str, str]
    ) -> Node:
        if not node_id or not address or ":" not in address:
            raise InvalidNode("node_id and a host:port address are required", node_id=node_id)
        if capacity < 0:
            raise InvalidNode("capacity cannot be negative", node_id=node_id)
        conn = self._connect(address)
        try:
            facts = await conn.info()
        except NodeUnreachable as exc:
            await conn.close()
            raise NodeUnreachable(
                f"node {address} does not answer: {exc}", address=address
            ) from None
        if facts.node_id != node_id:
            await conn.close()
            raise NodeIdMismatch(
                f"the node at {address} reports node_id {facts.node_id!r}, not {node_id!r}",
                node_id=node_id,
                reported=facts.node_id,
            )
        node = self.nodes.get(node_id)
        if node is None:
            node = self._add_node(node_id, address, capacity, dict(labels), conn)
        else:
            if node.address != address:
                old, node.conn, node.address = node.conn, conn, address
                await old.close()
                if node.health_task is not None:
                    node.health_task.cancel()
                node.health_task = asyncio.get_running_loop().create_task(
                    self._health_loop(node), name=f"pool.health.{node_id}"
                )
            else:
                await conn.close()
            node.asked_capacity, node.labels = capacity, dict(labels)
            if node.state in (N_DRAINING, N_DRAINED):
                node.state = N_PENDING
        self._persist_node(node)
        try:
            await self._sync(node)
        except (NodeUnreachable, NodeRejected) as exc:
            raise NodeUnreachable(
                f"node {address} failed to sync: {exc}", address=address
            ) from None
        if node.state in (N_PENDING, N_UNHEALTHY) and node.failures == 0:
            node.state = N_HEALTHY
        self._update_node_metrics()
        self._pump()
        return node

    def _persist_node(self, node: Node) -> None:
        if self._store is not None:
            self._store.put_node(
                StoredNode(
                    node.node_id,
                    node.address,
                    node.asked_capacity,
                    node.labels,
                    node.state in (N_DRAINING, N_DRAINED),
                )
            )

    async def drain_node(self, node_id: str, evict: bool) -> Node:
        node = self.nodes.get(node_id)
        if node is None:
            raise NodeNotFound(f"no node {node_id!r}", node_id=node_id)
        if node.state != N_DRAINED:
            node.state = N_DRAINING
        self._persist_node(node)
        for spare in list(node.spares.values()):
            self._spawn(self._destroy_spare(node, spare))
        if evict:
            for lease_id in list(node.leases):
                lease = self.leases[lease_id]
                if lease.state == ACTIVE:
                    self._end(lease, REVOKED, f"node {node_id} drained with evict")
        self._check_drained(node)
        self._update_node_metrics()
        return node

    def _check_drained(self, node: Node) -> None:
        if node.state == N_DRAINING and not node.leases and not node.spares:
            node.state = N_DRAINED
            self._update_node_metrics()

    async def _health_loop(self, node: Node) -> None:
        while True:
            try:
                async for serving in node.conn.watch_health():
                    if not serving:
                        self._health_failed(node, "node reports NOT_SERVING")
                        continue
                    if node.state in (N_PENDING, N_UNHEALTHY) or node.lost:
                        await self._sync(node)
                    node.failures, node.health_message, node.lost = 0, "", False
                    node.last_seen = time.time()
                    if node.state in (N_PENDING, N_UNHEALTHY):
                        node.state = N_HEALTHY
                        log.info("pool.node_healthy", node_id=node.node_id)
                        self._update_node_metrics()
                        self._pump()
                        self._maintain_now.set()
            except asyncio.CancelledError:
                raise
            except (NodeUnreachable, NodeRejected, NodeIdMismatch) as exc:
                self._health_failed(node, str(exc))
            except Exception as exc:
                log.exception("pool.health_loop_error", node_id=node.node_id)
                self._health_failed(node, repr(exc))
            await asyncio.sleep(self.settings.health_retry_interval_s)

    def _health_failed(self, node: Node, message: str) -> None:
        node.failures += 1
        node.health_message = message
        if node.state in (N_PENDING, N_HEALTHY):
            node.state = N_UNHEALTHY
            self._update_node_metrics()
        if node.failures >= self.settings.health_failure_threshold and not node.lost:
            node.lost = True
            log.warning("pool.node_lost", node_id=node.node_id, message=message)
            for lease_id in list(node.leases):
                lease = self.leases[lease_id]
                if lease.state == ACTIVE:
                    self._end(lease, NODE_LOST, f"node {node.node_id} lost: {message}")
            self._pump()  # The global cap no longer counts a lost node.

    async def _sync(self, node: Node) -> None:
        """Reads the node's capacity, images and sandboxes, and adopts or ends leases to match."""
        async with node.sync_lock:
            facts = await node.conn.info()
            if facts.node_id != node.node_id:
                raise NodeIdMismatch(
                    f"node at {node.address} now reports node_id {facts.node_id!r}",
                    node_id=node.node_id,
                )
            node.node_capacity, node.version = facts.capacity, facts.version
            node.images, node.images_time = await node.conn.images(), time.time()
            sandboxes = await node.conn.list_sandboxes()
            self._adopt(node, sandboxes)

    def _adopt(self, node: Node, sandboxes: Iterable[SandboxFacts]) -> None:
        now = time.time()
        seen: set[str] = set()
        adopted = strays = 0
        for sb in sandboxes:
            seen.add(sb.sandbox_id)
            if sb.lease_id:
                lease = self.leases.get(sb.lease_id)
                if lease is None:
                    if not sb.running:
                        self._spawn(self._destroy_stray(node, sb.sandbox_id))
                        continue
                    self._adopt_lease(node, sb, now)
                    adopted += 1
                elif lease.node_id == node.node_id and lease.sandbox_id in ("", sb.sandbox_id):
                    if lease.sandbox_id and lease.state == ACTIVE:
                        lease.node_expire_time = sb.expire_time
                else:  # A copy from a create whose reply was lost, or a lease that moved.
                    strays += 1
                    self._spawn(self._destroy_stray(node, sb.sandbox_id))
            elif LABEL_SPARE in sb.labels:
                spare_id = sb.labels[LABEL_SPARE]
                spare = node.spares.get(spare_id)
                if spare is not None and spare.sandbox_id in ("", sb.sandbox_id):
                    continue
                if not sb.running or (sb.image, sb.labels.get(LABEL_SPEC, "")) not in self.targets:
                    strays += 1
                    self._spawn(self._destroy_stray(node, sb.sandbox_id))
                    continue
                node.put_spare(
                    Spare(
                        spare_id,
                        node.node_id,
                        sb.image,
                        sb.labels.get(LABEL_SPEC, ""),
                        sb.sandbox_id,
                        sb.expire_time,
                        ready=True,
                    )
                )
        for lease_id in list(node.leases):
            lease = self.leases[lease_id]
            if not lease.sandbox_id or lease.sandbox_id in seen:
                continue
            # The node says the sandbox is gone: that is its destroy confirmation.
            if lease.state == ACTIVE:
                self._end(lease, SANDBOX_LOST, "the node no longer has the sandbox", destroy=False)
            if lease.state == RELEASING:
                self._finish(lease)
        for spare_id, spare in list(node.spares.items()):
            if spare.sandbox_id and spare.sandbox_id not in seen:
                node.pop_spare(spare_id)
        if adopted or strays:
            log.info("pool.node_synced", node_id=node.node_id, adopted=adopted, strays=strays)
        self._check_drained(node)
        self._update_lease_metrics()

    def _adopt_lease(self, node: Node, sb: SandboxFacts, now: float) -> None:
        slack = self.settings.node_expiry_slack_s
        ttl = float(sb.labels.get(LABEL_TTL, "0") or 0) or self.settings.default_ttl_s
        # The lease ran until about node expiry - slack; a holder whose renewals failed while
        # the pool was away gets until the node's own expiry to reconnect.
        expire = max(sb.expire_time - slack, min(sb.expire_time, now + slack))
        lease = Lease(
            lease_id=sb.lease_id,
            request_id=sb.labels.get(LABEL_REQUEST, ""),
            image=sb.image,
            instance_id=sb.instance_id,
            owner=sb.owner,
            ttl_s=ttl,
            spec=Spec(),
            spec_key="",
            node_selector={},
            create_time=now,
            state=ACTIVE,
            node_id=node.node_id,
            node_address=node.address,
            sandbox_id=sb.sandbox_id,
            expire_time=expire,
            node_expire_time=sb.expire_time,
        )
        self._issue_token(lease, ttl)
        self.leases[lease.lease_id] = lease
        self._activate(lease)
        if lease.request_id:
            self._by_request[lease.request_id] = lease
        node.hold(lease.lease_id)

    async def _destroy_stray(self, node: Node, sandbox_id: str) -> None:
        with contextlib.suppress(Exception):
            await node.conn.destroy(sandbox_id)

    # -- acquire --------------------------------------------------------------------------
    def _validate(self, request: AcquireRequest) -> None:
        s = self.settings
        if not request.image:
            raise InvalidLeaseRequest("image is required")
        if request.ttl_s < 0 or request.ttl_s > s.max_ttl_s:
            raise InvalidLeaseRequest(f"ttl must be between 0 and {s.max_ttl_s:g} s")
        if request.wait_s < 0 or request.wait_s > s.max_wait_s:
            raise InvalidLeaseRequest(f"wait_timeout must be between 0 and {s.max_wait_s:g} s")

    def _check_image(self, image: str, selector: Mapping[str, str]) -> None:
        healthy = False
        for node in self.nodes.values():
            if node.state == N_HEALTHY and node.matches(selector):
                if node.has_image(image):
                    return
                healthy = True
        if healthy:
            raise ImageNotPresent(
                f"no healthy node has image {image!r}; the pool never pulls (use EnsureImages)",
                image=image,
            )

    async def acquire(self, request: AcquireRequest) -> Lease:
        started = time.time()
        wait_s = min(request.wait_s or self.settings.default_wait_s, self.settings.max_wait_s)
        if request.request_id:
            existing = self._by_request.get(request.request_id)
            if existing is not None:
                return await self._await_ready(existing, started + wait_s)
        self._validate(request)
        self._check_image(request.image, request.node_selector)
        lease = Lease(
            lease_id="lse-" + uuid.uuid4().hex[:20],
            request_id=request.request_id,
            image=request.image,
            instance_id=request.instance_id,
            owner=request.owner,
            ttl_s=request.ttl_s or self.settings.default_ttl_s,
            spec=request.spec,
            spec_key=request.spec.key(),
            node_selector=dict(request.node_selector),
            create_time=started,
            ready=asyncio.get_running_loop().create_future(),
        )
        self.leases[lease.lease_id] = lease
        if lease.request_id:
            self._by_request[lease.request_id] = lease
        self._queue.append(lease)
        metrics.WAITING.set(len(self._queue))
        self._pump()
        return await self._await_ready(lease, started + wait_s)

    async def _await_ready(self, lease: Lease, deadline: float) -> Lease:
        if lease.ready is None or lease.ready.done():
            if lease.ready is not None and lease.ready.exception() is not None:
                raise lease.ready.exception()  # type: ignore[misc]
            return lease
        lease.waiters += 1
        try:
            try:
                await asyncio.wait_for(
                    asyncio.shield(lease.ready), timeout=max(0.0, deadline - time.time())
                )
            except asyncio.TimeoutError:
                if lease in self._queue:
                    waited = time.time() - lease.create_time
                    self._drop_queued(lease, NOT_FOUND)
                    raise PoolAtCapacity(
                        f"no capacity for image {lease.image!r} within {waited:.1f} s",
                        retry_delay_s=RETRY_DELAY_S,
                        image=lease.image,
                    ) from None
                # Its sandbox is being made right now: that ends soon either way.
                await asyncio.shield(lease.ready)
        except asyncio.CancelledError:
            if lease.waiters == 1 and lease in self._queue:
                self._drop_queued(lease, NOT_FOUND)
            raise
        finally:
            lease.waiters -= 1
        result = lease.ready.result()
        result.claimed = True
        return result

    def _drop_queued(self, lease: Lease, reason: str) -> None:
        self._queue.remove(lease)
        metrics.WAITING.set(len(self._queue))
        lease.state, lease.loss_reason = ENDED, reason
        self._ended_now(lease)
        if lease.request_id and self._by_request.get(lease.request_id) is lease:
            del self._by_request[lease.request_id]
        if lease.ready is not None and not lease.ready.done():
            lease.ready.set_exception(LeaseCancelled("the lease ended while it was queued"))
            lease.ready.exception()  # retrieved: waiters re-raise their own error

    def _global_free(self) -> float:
        cap = self.settings.max_leases
        if not cap:
            return float("inf")
        used = sum(n.used for n in self.nodes.values() if not n.lost)
        return cap - used

    def _choose(self, lease: Lease, may_create: bool) -> tuple[Node, Spare | None] | None:
        """A warm spare of the image and spec, else the least loaded node that has the image
        and room; only HEALTHY nodes matching the selector that have not failed this lease."""
        selector = lease.node_selector
        spares = self._index.spares.get((lease.image, lease.spec_key), {})
        for spare in spares.values():
            if not spare.ready or spare.destroying or spare.busy:
                continue
            node = self.nodes.get(spare.node_id)
            if (
                node is not None
                and node.state == N_HEALTHY
                and node.node_id not in lease.avoid
                and (not selector or node.matches(selector))
            ):
                return node, spare
        if not may_create:
            return None
        for used, node in self._index.by_load():
            if node.state != N_HEALTHY or used >= node.capacity or node.node_id in lease.avoid:
                continue
            if (not selector or node.matches(selector)) and node.has_image(lease.image):
                return node, None
        return None

    def _pump(self) -> None:
        """Places queued requests, oldest first, wherever there is room now."""
        if not self._queue:
            return
        free = self._global_free()
        placed: list[Lease] = []
        for lease in self._queue:
            choice = self._choose(lease, free > 0)
            if choice is None:
                # Full for this request; a younger request for another image may still fit.
                continue
            node, spare = choice
            if spare is None:
                free -= 1
            placed.append(lease)
            lease.wait_duration_s = time.time() - lease.create_time
            node.hold(lease.lease_id)
            lease.node_id, lease.node_address = node.node_id, node.address
            if spare is not None:
                node.pop_spare(spare.spare_id)
            self._spawn(self._place(lease, node, spare))
        if placed:
            ids = {id(lease) for lease in placed}
            self._queue = [lease for lease in self._queue if id(lease) not in ids]
            metrics.WAITING.set(len(self._queue))
        elif self._queue and any(
            s.ready and not s.destroying
            for spares in self._index.spares.values()
            for s in spares.values()
        ):
            # Requests wait while spares of other images hold the room: give one back.
            self._maintain_now.set()

    async def _place(self, lease: Lease, node: Node, spare: Spare | None) -> None:
        slack = self.settings.node_expiry_slack_s
        try:
            if spare is not None:
                facts = await node.conn.bind(
                    spare.sandbox_id,
                    lease.lease_id,
                    lease.owner,
                    lease.instance_id,
                    lease.ttl_s + slack,
                )
            else:
                facts = await node.conn.create(self._create_request(lease))
        except (NodeUnreachable, NodeFull, NodeImageMissing, NodeSandboxGone) as exc:
            node.unhold(lease.lease_id)
            lease.node_id = lease.node_address = ""
            if isinstance(exc, NodeImageMissing):
                node.images -= set(image_names(lease.image))
            if spare is None or isinstance(exc, NodeUnreachable):
                lease.avoid.add(node.node_id)
            log.warning(
                "pool.place_failed", lease_id=lease.lease_id, node_id=node.node_id, error=str(exc)
            )
            if lease.state == PENDING:
                self._queue.insert(0, lease)  # It keeps its place at the head.
                metrics.WAITING.set(len(self._queue))
            elif lease.state == RELEASING:
                self._finish(lease)
            self._pump()
            return
        except NodeRejected as exc:
            node.unhold(lease.lease_id)
            self._pump()
            error: SwerlError = (
                InvalidLeaseRequest(str(exc), node_reason=exc.reason)
                if exc.code == "INVALID_ARGUMENT"
                else Internal(f"the node refused the sandbox: {exc}")
            )
            self._fail(lease, error)
            return
        except Exception as exc:  # A bug must not leave the request waiting forever.
            node.unhold(lease.lease_id)
            log.exception("pool.place_error", lease_id=lease.lease_id)
            self._fail(lease, Internal(f"placing the lease failed: {exc!r}"))
            return
        now = time.time()
        lease.sandbox_id = facts.sandbox_id
        lease.node_expire_time = facts.expire_time
        lease.from_warm_spare = spare is not None
        if lease.state != PENDING:  # Released while the sandbox was being made.
            self._start_destroy(lease)
            return
        lease.state = ACTIVE
        lease.expire_time = now + lease.ttl_s
        self._issue_token(lease, lease.ttl_s)
        self._activate(lease)
        metrics.ACQUIRE_SECONDS.labels("warm" if spare else "cold").observe(now - lease.create_time)
        self._update_lease_metrics()
        if lease.ready is not None and not lease.ready.done():
            lease.ready.set_result(lease)
        if lease.waiters == 0:
            if not lease.request_id:  # Nobody will ever hold it.
                self._end(lease, RELEASED, "the caller went away")
            else:  # The caller left mid-create; a retry with its request_id may still claim it.
                self._spawn(self._release_if_unclaimed(lease))
        if spare is not None:
            self._maintain_now.set()  # Refill.

    async def _release_if_unclaimed(self, lease: Lease) -> None:
        await asyncio.sleep(self.settings.unclaimed_grace_s)
        if lease.state == ACTIVE and not lease.claimed and not lease.watchers:
            self._end(lease, RELEASED, "every AcquireLease caller went away before it was ready")

    def _create_request(self, lease: Lease) -> CreateRequest:
        labels = {**lease.spec.labels, LABEL_TTL: f"{lease.ttl_s:g}"}
        if lease.request_id:
            labels[LABEL_REQUEST] = lease.request_id
        return self._spec_request(
            lease.spec,
            request_id=lease.lease_id,
            image=lease.image,
            ttl_s=lease.ttl_s + self.settings.node_expiry_slack_s,
            lease_id=lease.lease_id,
            owner=lease.owner,
            instance_id=lease.instance_id,
            labels=labels,
        )

    @staticmethod
    def _spec_request(spec: Spec, **fields) -> CreateRequest:
        return CreateRequest(
            workdir=spec.workdir,
            env=spec.env,
            cpus=spec.cpus,
            memory_bytes=spec.memory_bytes,
            pids=spec.pids,
            network=spec.network,
            **fields,
        )

    def _fail(self, lease: Lease, error: SwerlError) -> None:
        lease.state = ENDED
        self._ended_now(lease)
        lease.node_id = lease.node_address = ""
        if lease.request_id and self._by_request.get(lease.request_id) is lease:
            del self._by_request[lease.request_id]
        if lease.ready is not None and not lease.ready.done():
            lease.ready.set_exception(error)
            lease.ready.exception()

    def _issue_token(self, lease: Lease, ttl_s: float) -> None:
        """Makes the lease's token valid at least token_grace_s past its expiry.

        A new token runs ttl x token_reissue_fraction further, and renewals keep it until that
        margin is used up: minting (an HMAC) on every renewal was the largest part of a
        renewal's cost at 20,000 renewals a second.
        """
        if self._secret is None:
            return
        wanted = lease.expire_time + self.settings.token_grace_s
        if lease.token and lease.token_expire_time >= wanted:
            return
        expire = wanted + ttl_s * self.settings.token_reissue_fraction
        lease.token = capability.mint(
            self._secret, lease_id=lease.lease_id, sandbox_id=lease.sandbox_id, expire_time=expire
        )
        lease.token_expire_time = int(expire * 1000) / 1000  # What nodes read (whole ms).

    # -- keepalive ------------------------------------------------------------------------
    def open_watcher(self) -> Watcher:
        return Watcher()

    def close_watcher(self, watcher: Watcher) -> None:
        for lease_id in watcher.leases:
            lease = self.leases.get(lease_id)
            if lease is not None:
                lease.watchers.discard(watcher)
        watcher.leases.clear()

    def watch(self, watcher: Watcher, lease_id: str) -> Lease | None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.state in (RELEASING, ENDED):
            reason = lease.loss_reason if lease is not None else NOT_FOUND
            message = lease.loss_message if lease is not None else "the pool has no such lease"
            watcher.events.put_nowait(Lost(lease_id, reason or NOT_FOUND, message))
            return None
        watcher.leases.add(lease_id)
        lease.watchers.add(watcher)
        lease.claimed = True
        if lease.state == ACTIVE:
            watcher.events.put_nowait(Expiry(lease_id, lease.expire_time, lease.token))
        return lease

    async def renew(self, watcher: Watcher, lease_id: str, ttl_s: float) -> None:
        expiry = await self._renew(watcher, lease_id, ttl_s)
        if expiry is not None:
            watcher.events.put_nowait(expiry)

    async def renew_batch(self, watcher: Watcher, renewals: Iterable[tuple[str, float]]) -> None:
        """Renews many leases; one ExpiryBatch for those alive, a Lost for each that ended."""
        expiries: list[Expiry] = []
        slow: list[tuple[str, float]] = []
        leases, max_ttl = self.leases, self.settings.max_ttl_s
        margin = self.settings.node_expiry_slack_s / 2
        now = time.time()
        for count, (lease_id, ttl_s) in enumerate(renewals, 1):
            if count % RENEW_SLICE == 0:
                await asyncio.sleep(0)
                now = time.time()
            # Most renewals need no node call (the node's expiry is kept ahead): done inline.
            lease = leases.get(lease_id)
            if lease is not None and lease.state == ACTIVE:
                ttl = min(ttl_s if ttl_s > 0 else lease.ttl_s, max_ttl)
                if lease.node_expire_time >= now + ttl + margin:
                    expiries.append(self._extend(watcher, lease, ttl, now))
                    continue
            slow.append((lease_id, ttl_s))
        if slow:
            results = await asyncio.gather(*(self._renew(watcher, i, t) for i, t in slow))
            expiries.extend(e for e in results if e is not None)
        if expiries:
            watcher.events.put_nowait(ExpiryBatch(expiries))

    def _ttl(self, lease: Lease, ttl_s: float) -> float:
        return min(ttl_s if ttl_s > 0 else lease.ttl_s, self.settings.max_ttl_s)

    def _extend(
        self, watcher: Watcher, lease: Lease, ttl: float, now: float, cap: float | None = None
    ) -> Expiry:
        """Moves the lease's expiry to now + ttl (no further than `cap`), never backwards."""
        watcher.leases.add(lease.lease_id)
        lease.watchers.add(watcher)
        wanted = now + ttl
        if cap is not None:
            wanted = min(wanted, cap)
        if wanted > lease.expire_time:
            lease.expire_time = wanted
            self._issue_token(lease, ttl)
        return Expiry(lease.lease_id, lease.expire_time, lease.token)

    async def _renew(self, watcher: Watcher, lease_id: str, ttl_s: float) -> Expiry | None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.state != ACTIVE:
            self.watch(watcher, lease_id)
            return None
        cap = None
        ttl = self._ttl(lease, ttl_s)
        if lease.node_expire_time < time.time() + ttl + self.settings.node_expiry_slack_s / 2:
            node = self.nodes.get(lease.node_id)
            try:
                if node is None:
                    raise NodeUnreachable("the lease's node is not registered")
                lease.node_expire_time = await node.conn.renew(
                    lease.sandbox_id, ttl + self.settings.node_expiry_slack_s
                )
            except NodeSandboxGone:
                if lease.state == ACTIVE:
                    self._end(lease, SANDBOX_LOST, "the node no longer has the sandbox")
                return None
            except (NodeUnreachable, NodeRejected):
                # What the node enforces is what is reported.
                cap = lease.node_expire_time
        if lease.state != ACTIVE:
            return None
        return self._extend(watcher, lease, ttl, time.time(), cap)

    # -- release, expiry, destroy ----------------------------------------------------------
    async def release(self, lease_id: str) -> tuple[bool, Lease | None]:
        lease = self.leases.get(lease_id)
        if lease is None or lease.state == ENDED:
            return False, lease
        if lease.state == PENDING:
            if lease in self._queue:
                self._drop_queued(lease, RELEASED)
                return True, lease
            lease.state, lease.loss_reason = RELEASING, RELEASED  # _place finishes it.
            self._releasing[lease.lease_id] = lease
            return True, lease
        if lease.state == ACTIVE:
            self._end(lease, RELEASED, "released")
        if lease.destroying is not None:
            # Bounded: a node that hangs leaves the lease RELEASING (retried in the background).
            await asyncio.wait([lease.destroying], timeout=self.settings.release_wait_s)
        return True, lease

    def _end(self, lease: Lease, reason: str, message: str, *, destroy: bool = True) -> None:
        """ACTIVE -> RELEASING: tells the watchers, then destroys the sandbox."""
        lease.state, lease.loss_reason, lease.loss_message = RELEASING, reason, message
        self._active.pop(lease.lease_id, None)
        self._releasing[lease.lease_id] = lease
        metrics.LEASE_ENDS.labels(reason).inc()
        log.info("pool.lease_ended", lease_id=lease.lease_id, reason=reason, message=message)
        for watcher in lease.watchers:
            watcher.events.put_nowait(Lost(lease.lease_id, reason, message))
            watcher.leases.discard(lease.lease_id)
        lease.watchers.clear()
        if destroy:
            self._start_destroy(lease)
        self._update_lease_metrics()

    def _start_destroy(self, lease: Lease) -> None:
        if lease.destroying is None or lease.destroying.done():
            lease.destroying = self._spawn(self._destroy(lease))

    async def _destroy(self, lease: Lease) -> None:
        node = self.nodes.get(lease.node_id)
        if node is None or not lease.sandbox_id:
            self._finish(lease)
            return
        try:
            await node.conn.destroy(lease.sandbox_id)
        except Exception as exc:
            # The capacity stays held: the maintenance loop retries once the node answers.
            metrics.DESTROY_FAILURES.inc()
            log.warning("pool.destroy_failed", lease_id=lease.lease_id, error=str(exc))
            return
        self._finish(lease)

    def _finish(self, lease: Lease) -> None:
        """RELEASING -> ENDED once the node confirmed the sandbox gone: frees the capacity."""
        lease.state = ENDED
        self._ended_now(lease)
        self._active.pop(lease.lease_id, None)
        node = self.nodes.get(lease.node_id)
        if node is not None:
            node.unhold(lease.lease_id)
            self._check_drained(node)
        if lease.request_id and self._by_request.get(lease.request_id) is lease:
            # Kept while the lease lives (a retry returns it); a finished one is not reused.
            del self._by_request[lease.request_id]
        self._update_lease_metrics()
        self._pump()

    def _activate(self, lease: Lease) -> None:
        self._active[lease.lease_id] = lease
        self._push_expiry(lease)

    def _push_expiry(self, lease: Lease) -> None:
        lease.expiry_seq = next(self._seq)
        heapq.heappush(self._expiries, (lease.expire_time, lease.expiry_seq, lease.lease_id))

    def _ended_now(self, lease: Lease) -> None:
        lease.ended_time = time.time()
        self._releasing.pop(lease.lease_id, None)
        self._ended.append(lease)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.expiry_interval_s)
            self._expire_due(time.time())

    def _expire_due(self, now: float) -> None:
        """Ends the ACTIVE leases whose expiry has passed. Only heap entries that came due are
        looked at: an expiry only ever moves later, so an entry is never later than its lease's
        expiry; one whose lease was renewed meanwhile is pushed again at the current expiry."""
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, seq, lease_id = heapq.heappop(heap)
            lease = self._active.get(lease_id)
            if lease is None or lease.expiry_seq != seq:
                continue  # Ended already, or a stale entry of a lease adopted under its id.
            if lease.expire_time <= now:
                self._end(lease, EXPIRED, "not renewed before its expiry")
            else:
                self._push_expiry(lease)

    # -- warm spares ----------------------------------------------------------------------
    def prewarm(self, image: str, count: int, spec: Spec) -> tuple[int, int]:
        if not image:
            raise InvalidLeaseRequest("image is required")
        if count < 0:
            raise InvalidLeaseRequest("count cannot be negative")
        key = spec.key()
        if count > 0:
            self._check_image(image, {})
            self.targets[(image, key)] = Target(image, spec, count)
        else:
            self.targets.pop((image, key), None)
        if self._store is not None:
            self._store.put_target(StoredTarget(image, key, spec.as_dict(), count))
        self._maintain_now.set()
        return self.spare_counts(image, key)

    def spare_counts(self, image: str, key: str) -> tuple[int, int]:
        ready = pending = 0
        for node in self.nodes.values():
            for spare in node.spares.values():
                if spare.image == image and spare.spec_key == key:
                    if spare.ready and not spare.destroying:
                        ready += 1
                    else:
                        pending += 1
        return ready, pending

    def _tend_spares(self) -> None:
        now = time.time()
        have: dict[tuple[str, str], list[Spare]] = {}
        for node in self.nodes.values():
            for spare in list(node.spares.values()):
                if spare.destroying:
                    if not spare.busy:
                        self._spawn(self._destroy_spare(node, spare))
                    continue
                key = (spare.image, spare.spec_key)
                if key not in self.targets or node.state != N_HEALTHY:
                    if node.state in (N_HEALTHY, N_DRAINING):
                        self._spawn(self._destroy_spare(node, spare))
                    continue
                have.setdefault(key, []).append(spare)
                if (
                    spare.ready
                    and not spare.busy
                    and spare.expire_time - now < self.settings.spare_ttl_s / 2
                ):
                    self._spawn(self._renew_spare(node, spare))
        # Requests waiting come first: spares are only made with room to spare.
        if self._queue:
            idle = [s for spares in have.values() for s in spares if s.ready and not s.busy]
            if idle:
                spare = idle[0]
                self._spawn(self._destroy_spare(self.nodes[spare.node_id], spare))
            return
        free = self._global_free()
        for key, target in self.targets.items():
            spares = have.get(key, [])
            missing = target.count - len(spares)
            for spare in spares[target.count :]:
                if spare.ready and not spare.busy:
                    self._spawn(self._destroy_spare(self.nodes[spare.node_id], spare))
            while missing > 0 and free > 0:
                node = self._node_for_spare(target.image)
                if node is None:
                    break
                spare = Spare("spr-" + uuid.uuid4().hex[:20], node.node_id, target.image, key[1])
                spare.busy = True
                node.put_spare(spare)
                self._spawn(self._create_spare(node, spare, target))
                missing -= 1
                free -= 1

    def _node_for_spare(self, image: str) -> Node | None:
        for used, node in self._index.by_load():
            if node.state == N_HEALTHY and used < node.capacity and node.has_image(image):
                return node
        return None

    async def _create_spare(self, node: Node, spare: Spare, target: Target) -> None:
        labels = {**target.spec.labels, LABEL_SPARE: spare.spare_id, LABEL_SPEC: spare.spec_key}
        try:
            facts = await node.conn.create(
                self._spec_request(
                    target.spec,
                    request_id=spare.spare_id,
                    image=target.image,
                    ttl_s=self.settings.spare_ttl_s,
                    owner=SPARE_OWNER,
                    labels=labels,
                )
            )
        except Exception as exc:
            node.pop_spare(spare.spare_id)
            if isinstance(exc, NodeImageMissing):
                node.images -= set(image_names(target.image))
            log.warning("pool.spare_failed", node_id=node.node_id, error=str(exc))
            self._pump()
            return
        spare.sandbox_id, spare.expire_time, spare.busy = facts.sandbox_id, facts.expire_time, False
        if spare.spare_id not in node.spares:
            node.put_spare(spare)  # Count it until its destroy is confirmed.
            spare.destroying = True
            await self._destroy_spare(node, spare)
            return
        spare.ready = True
        metrics.SPARES.inc()
        self._pump()

    async def _renew_spare(self, node: Node, spare: Spare) -> None:
        spare.busy = True
        try:
            spare.expire_time = await node.conn.renew(spare.sandbox_id, self.settings.spare_ttl_s)
        except NodeSandboxGone:
            node.pop_spare(spare.spare_id)
        except Exception:
            pass
        finally:
            spare.busy = False

    async def _destroy_spare(self, node: Node, spare: Spare) -> None:
        if spare.busy and not spare.destroying:
            return
        spare.destroying, spare.busy = True, True
        try:
            if spare.sandbox_id:
                await node.conn.destroy(spare.sandbox_id)
        except Exception as exc:
            metrics.DESTROY_FAILURES.inc()
            log.warning("pool.spare_destroy_failed", node_id=node.node_id, error=str(exc))
            spare.busy = False
            return
        if node.pop_spare(spare.spare_id) is not None and spare.ready:
            metrics.SPARES.dec()
        self._check_drained(node)
        self._pump()

    # -- maintenance ----------------------------------------------------------------------
    async def _maintenance_loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._maintain_now.wait(), timeout=self.settings.maintenance_interval_s
                )
            self._maintain_now.clear()
            try:
                self._maintain()
            except Exception:
                log.exception("pool.maintenance_error")

    def _maintain(self) -> None:
        now = time.time()
        for lease in list(self._releasing.values()):
            if lease.state != RELEASING:
                del self._releasing[lease.lease_id]
            elif lease.sandbox_id:
                node = self.nodes.get(lease.node_id)
                if node is not None and node.state != N_UNHEALTHY:
                    self._start_destroy(lease)
        ended = self._ended
        while ended and now - ended[0].ended_time > self.settings.ended_retention_s:
            lease = ended.popleft()
            if lease.state == ENDED and self.leases.get(lease.lease_id) is lease:
                del self.leases[lease.lease_id]
        for lease in self._queue:
            lease.avoid.clear()
        for node in self.nodes.values():
            if node.state == N_HEALTHY and now - node.images_time > (
                self.settings.image_refresh_interval_s
            ):
                node.images_time = now
                self._spawn(self._refresh_images(node))
        self._tend_spares()
        self._pump()

    async def _refresh_images(self, node: Node) -> None:
        with contextlib.suppress(Exception):
            node.images = await node.conn.images()
            self._pump()

    # -- queries --------------------------------------------------------------------------
    def list_leases(
        self,
        *,
        owner: str = "",
        node_id: str = "",
        instance_id: str = "",
        image: str = "",
        states: Iterable[str] = (),
    ) -> list[Lease]:
        wanted = set(states) or {PENDING, ACTIVE, RELEASING}
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

    def list_nodes(self, states: Iterable[str] = ()) -> list[Node]:
        wanted = set(states)
        return [n for n in self.nodes.values() if not wanted or n.state in wanted]

    def _update_lease_metrics(self) -> None:
        metrics.LEASES.labels(ACTIVE).set(len(self._active))
        metrics.LEASES.labels(PENDING).set(len(self._queue))

    def _update_node_metrics(self) -> None:
        counts = dict.fromkeys((N_PENDING, N_HEALTHY, N_UNHEALTHY, N_DRAINING, N_DRAINED), 0)
        for node in self.nodes.values():
            counts[node.state] += 1
            metrics.NODE_HEALTHY.labels(node.node_id).set(1 if node.state == N_HEALTHY else 0)
        for state, count in counts.items():
            metrics.NODES.labels(state).set(count)
