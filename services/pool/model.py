"""The pool's records: leases, nodes, warm spares and the states they move through.

Plain data, no behaviour beyond keeping `LoadIndex` in step with what a node holds: the lease
lifecycle (which state follows which, and what each move updates) is `swerl.pool.state`, the
choice of a node is `swerl.pool.placement`. No grpc here.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from swerl.chassis.images import image_key
from swerl.pool.nodes import CreateRequest, NodeConnection

if TYPE_CHECKING:
    from swerl.pool.pulls import Pull


class _Named(str, enum.Enum):
    """A state named as its proto enum value is, without the prefix; prints as that name
    (metric labels and log fields read "ACTIVE", not "LeaseState.ACTIVE")."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)


class LeaseState(_Named):
    PENDING = "PENDING"  # queued, or its sandbox is being made
    PULLING = "PULLING"  # placed on a node that pulls its image first (capacity held)
    ACTIVE = "ACTIVE"  # handed out; renewed by its holder
    RELEASING = "RELEASING"  # ended; its sandbox is being destroyed (capacity still held)
    ENDED = "ENDED"  # the node confirmed the sandbox gone (kept a while for ListLeases)


# Short names of the states, as the pool's modules, callers and tests know them.
PENDING, PULLING, ACTIVE, RELEASING, ENDED = (
    LeaseState.PENDING,
    LeaseState.PULLING,
    LeaseState.ACTIVE,
    LeaseState.RELEASING,
    LeaseState.ENDED,
)


class LossReason(_Named):
    """Why a lease ended."""

    RELEASED = "RELEASED"
    EXPIRED = "EXPIRED"
    NODE_LOST = "NODE_LOST"
    SANDBOX_LOST = "SANDBOX_LOST"
    REVOKED = "REVOKED"
    NOT_FOUND = "NOT_FOUND"


class NodeState(_Named):
    PENDING = "PENDING"  # registered, not yet synced
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    DRAINING = "DRAINING"  # takes nothing new; drained once it holds nothing
    DRAINED = "DRAINED"


# Caller labels the pool writes on its sandboxes, so a restarted pool can read them back.
LABEL_SPARE = "pool.spare"  # spare id, on warm spares
LABEL_SPEC = "pool.spec"  # spec key, on warm spares
LABEL_TTL = "pool.ttl_s"  # the lease's ttl
LABEL_REQUEST = "pool.request_id"  # the AcquireLease request_id

SPARE_OWNER = "swerl-pool/spare"


@dataclass
class Spec:
    """Sandbox settings of a lease or a spare (SandboxSpec)."""

    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    cpus: float = 0.0
    memory_bytes: int = 0
    pids: int = 0
    network: int = 0  # a swerl.exec.v1.NetworkMode number, passed to the node as is
    labels: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "workdir": self.workdir,
            "env": dict(sorted(self.env.items())),
            "cpus": self.cpus,
            "memory_bytes": self.memory_bytes,
            "pids": self.pids,
            "network": self.network,
            "labels": dict(sorted(self.labels.items())),
        }

    def create_request(self, **fields: Any) -> CreateRequest:
        """The node's CreateSandbox call for a sandbox of this spec."""
        return CreateRequest(
            workdir=self.workdir,
            env=self.env,
            cpus=self.cpus,
            memory_bytes=self.memory_bytes,
            pids=self.pids,
            network=self.network,
            **fields,
        )

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
    # Nodes to avoid while another has room (AcquireLeaseRequest.prefer_not_node_ids).
    prefer_not: frozenset[str] = frozenset()


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
    state: LeaseState = LeaseState.PENDING
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
    loss_reason: LossReason | None = None
    loss_message: str = ""
    from_warm_spare: bool = False
    wait_duration_s: float = 0.0
    # The image pull this lease waits on (PULLING), and how long it waited on pulls in all.
    pull: Pull | None = None
    pull_duration_s: float = 0.0
    ended_time: float = 0.0
    ready: asyncio.Future[Lease] | None = None
    waiters: int = 0
    # Set once a caller has received the lease (an AcquireLease answer or a KeepAlive watch);
    # an unclaimed lease whose callers all went away is released after a grace period.
    claimed: bool = False
    avoid: set[str] = field(default_factory=set)
    # Nodes the holder asked to avoid while another has room (placement.choose).
    prefer_not: frozenset[str] = frozenset()
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
    state: NodeState = NodeState.PENDING
    node_capacity: int = 0
    images: set[str] = field(default_factory=set)
    images_time: float = 0.0
    # The node's image cache: its disk budget and what its images take (0: not reported).
    image_budget_bytes: int = 0
    image_used_bytes: int = 0
    # Placements that found their image on the node (or a spare of it), placements that
    # waited on a pull there, and pulls the pool started on it (leases and prefetches).
    image_hits: int = 0
    image_misses: int = 0
    image_pulls: int = 0
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
    reason: LossReason
    message: str


class Watcher:
    """One KeepAlive stream: the leases it watches and the events to send it."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[Expiry | ExpiryBatch | Lost | None] = asyncio.Queue()
        self.leases: set[str] = set()


@functools.lru_cache(maxsize=4096)
def image_names(image: str) -> tuple[str, ...]:
    """The names a present image may be listed under: as written, and as Docker lists it
    (`image_key`: "x" is "x:latest", Docker Hub's registry and `library/` dropped)."""
    return tuple(dict.fromkeys((image, image_key(image))))


def parse_static_node(text: str) -> tuple[str, str]:
    """ "node_id=host:port" -> (node_id, address); a bare address has no id yet ("")."""
    node_id, sep, address = text.partition("=")
    return (node_id.strip(), address.strip()) if sep else ("", text.strip())
