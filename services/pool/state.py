"""The pool's shared state and the lease lifecycle: every collection the pool keeps, and the one
function that moves a lease from state to state and keeps all of them consistent.

    (admit) --> PENDING --placed--> ACTIVE --ended--> RELEASING --destroy confirmed--> ENDED
                 |  ^  |                                 ^                               ^
                 |  |  +--released while being placed----+                               |
                 |  |  +--dropped from the queue, or its placement failed ---------------+
                 |  +--pulled (its sandbox is made next), or the node failed (requeued)  |
                 +--placed on a node without its image--> PULLING --pull failed, released,
                                                                    or its wait ran out--+

Which collections hold a lease, by state:
  leases       every lease, ENDED ones until ended_retention_s has passed (ListLeases)
  by_request   a lease by its AcquireLease request_id, while it is not ENDED (a retry returns it)
  queue        PENDING leases waiting for room, oldest first (a PENDING lease with a node_id is
               being placed and is not queued; a PULLING lease holds its node and is not queued)
  active       ACTIVE leases; `expiries` holds an entry per ACTIVE lease (the expiry loop's heap)
  releasing    RELEASING leases (their destroys are retried by the maintenance loop)
  ended        ENDED leases, oldest first (dropped from `leases` after the retention)
  node.leases  a lease holds its node's capacity from placement until its destroy is confirmed
  watchers     the KeepAlive streams watching an ACTIVE lease (told once it ends)

`transition` is the only place that changes `lease.state` after admission; everything that
depends on a move happens there. One PoolState on one asyncio loop: no locks, every change
happens between awaits. No grpc here.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from swerl.chassis.errors import SwerlError
from swerl.pool import metrics
from swerl.pool.errors import LeaseCancelled
from swerl.pool.model import (
    ACTIVE,
    ENDED,
    PENDING,
    PULLING,
    RELEASING,
    Lease,
    LeaseState,
    LoadIndex,
    LossReason,
    Lost,
    Node,
    NodeState,
    Target,
)
from swerl.pool.settings import PoolSettings

log = structlog.get_logger("swerl.pool")


# The moves a lease can make; anything else is a bug in the pool.
TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    PENDING: frozenset({PULLING, ACTIVE, RELEASING, ENDED}),
    PULLING: frozenset({PENDING, ENDED}),
    ACTIVE: frozenset({RELEASING}),
    RELEASING: frozenset({ENDED}),
    ENDED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A lease was asked to make a move the lifecycle does not have."""


class PoolState:
    """What the pool knows, shared by its parts (registry, queue, spares, keepalive)."""

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self.nodes: dict[str, Node] = {}
        self.index = LoadIndex()
        self.leases: dict[str, Lease] = {}
        self.by_request: dict[str, Lease] = {}
        self.queue: list[Lease] = []
        self.active: dict[str, Lease] = {}
        # A heap of (expiry, seq, lease_id) with one entry per ACTIVE lease (renewals do not
        # touch it: an entry that comes due early is pushed again at the lease's current expiry;
        # entries hold no objects, so the garbage collector does not track them).
        self.expiries: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.releasing: dict[str, Lease] = {}
        self.ended: collections.deque[Lease] = collections.deque()
        self.targets: dict[tuple[str, str], Target] = {}
        self.background: set[asyncio.Task[Any]] = set()
        self.maintain_now = asyncio.Event()
        # Places queued requests wherever there is room; set by the queue (swerl.pool.queue),
        # called by every part that frees or adds room.
        self.pump: Callable[[], None] = lambda: None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    # -- the lease lifecycle -------------------------------------------------------------
    def admit(self, lease: Lease) -> None:
        """Enters a new lease: PENDING ones join the queue's tail; ACTIVE ones are adopted from
        a node (a restarted pool, or a node that came back) and hold their node at once."""
        self.leases[lease.lease_id] = lease
        if lease.request_id:
            self.by_request[lease.request_id] = lease
        if lease.state is PENDING:
            self.queue.append(lease)
            metrics.WAITING.set(len(self.queue))
        elif lease.state is ACTIVE:
            self._activate(lease)
            self.nodes[lease.node_id].hold(lease.lease_id)
        else:
            raise InvalidTransition(f"a lease cannot enter the pool {lease.state}")

    def transition(
        self,
        lease: Lease,
        to: LeaseState,
        *,
        reason: LossReason | None = None,
        message: str = "",
        error: SwerlError | None = None,
    ) -> bool:
        """Moves `lease` to `to` and updates every collection that depends on its state.

        `reason`/`message` say why a lease leaves PENDING or ACTIVE for good; `error` is what
        the callers still waiting for a lease get when it ends before it was ready (default for
        a PENDING lease: LeaseCancelled). Finishing a lease that is ENDED already (two destroy
        confirmations) does nothing and returns False.
        """
        before = lease.state
        if to is ENDED and before is ENDED:
            return False
        if to not in TRANSITIONS[before]:
            raise InvalidTransition(f"lease {lease.lease_id}: {before} -> {to}")
        lease.state = to
        if before is PENDING:
            if to is ACTIVE:  # Its sandbox is ready (expiry and token set by the caller).
                self._activate(lease)
                self.update_lease_metrics()
            elif to is RELEASING:  # Released while its sandbox is being made: the placement
                lease.loss_reason = LossReason.RELEASED  # destroys it once made.
                self.releasing[lease.lease_id] = lease
            elif to is ENDED:
                self._end_pending(lease, reason, error)
            # -> PULLING: placed on a node that pulls the image first; it holds that room.
        elif before is PULLING:
            if to is ENDED:  # The pull failed, or it was released or timed out meanwhile.
                self._end_pulling(lease, reason, error)
            # -> PENDING: pulled, its sandbox is made next; or requeued by its placer.
        elif before is ACTIVE:  # -> RELEASING
            self._leave_active(lease, reason or LossReason.RELEASED, message)
        else:  # RELEASING -> ENDED: the node confirmed the sandbox gone; its room is free.
            self._ended_now(lease)
            self.active.pop(lease.lease_id, None)
            node = self.nodes.get(lease.node_id)
            if node is not None:
                node.unhold(lease.lease_id)
                self.check_drained(node)
            self._forget_request(lease)
            self.update_lease_metrics()
            if error is not None:  # Its placement failed after it was released.
                self._reject_waiters(lease, error)
        return True

    def end(self, lease: Lease, reason: LossReason, message: str, *, destroy: bool = True) -> None:
        """ACTIVE -> RELEASING, then destroys its sandbox (unless the node says it is gone)."""
        self.transition(lease, RELEASING, reason=reason, message=message)
        if destroy:
            self.start_destroy(lease)

    def finish(self, lease: Lease) -> None:
        """RELEASING -> ENDED once the node confirmed the sandbox gone: frees the room."""
        if self.transition(lease, ENDED):
            self.pump()

    def start_destroy(self, lease: Lease) -> None:
        if lease.destroying is None or lease.destroying.done():
            lease.destroying = self.spawn(self._destroy(lease))

    async def _destroy(self, lease: Lease) -> None:
        node = self.nodes.get(lease.node_id)
        if node is None or not lease.sandbox_id:
            self.finish(lease)
            return
        try:
            await node.conn.destroy(lease.sandbox_id)
        except Exception as exc:
            # The room stays held: the maintenance loop retries once the node answers.
            metrics.DESTROY_FAILURES.inc()
            log.warning("pool.destroy_failed", lease_id=lease.lease_id, error=str(exc))
            return
        self.finish(lease)

    def _end_pending(
        self, lease: Lease, reason: LossReason | None, error: SwerlError | None
    ) -> None:
        if lease.node_id:  # Its placement failed (the placer gave its node's room back).
            lease.node_id = lease.node_address = ""
        else:  # It left the queue (released, timed out, or its caller went away).
            self.queue.remove(lease)
            metrics.WAITING.set(len(self.queue))
            lease.loss_reason = reason
        self._ended_now(lease)
        self._forget_request(lease)
        self._reject_waiters(lease, error or LeaseCancelled("the lease ended while it was queued"))

    def _end_pulling(
        self, lease: Lease, reason: LossReason | None, error: SwerlError | None
    ) -> None:
        """PULLING -> ENDED: gives its node's room back at once (the pull itself goes on for
        whoever else waits on it, or as a prefetch)."""
        node = self.nodes.get(lease.node_id)
        if node is not None:
            node.unhold(lease.lease_id)
        lease.node_id = lease.node_address = ""
        lease.loss_reason, lease.pull = reason, None
        self._ended_now(lease)
        self._forget_request(lease)
        self._reject_waiters(lease, error or LeaseCancelled("the lease ended while it was pulling"))
        self.pump()

    @staticmethod
    def _reject_waiters(lease: Lease, error: SwerlError) -> None:
        if lease.ready is not None and not lease.ready.done():
            lease.ready.set_exception(error)
            lease.ready.exception()  # retrieved: waiters re-raise their own error

    def _leave_active(self, lease: Lease, reason: LossReason, message: str) -> None:
        """ACTIVE -> RELEASING: tells the watchers; the caller starts the destroy."""
        lease.loss_reason, lease.loss_message = reason, message
        self.active.pop(lease.lease_id, None)
        self.releasing[lease.lease_id] = lease
        metrics.LEASE_ENDS.labels(reason).inc()
        log.info("pool.lease_ended", lease_id=lease.lease_id, reason=reason, message=message)
        for watcher in lease.watchers:
            watcher.events.put_nowait(Lost(lease.lease_id, reason, message))
            watcher.leases.discard(lease.lease_id)
        lease.watchers.clear()
        self.update_lease_metrics()

    def _activate(self, lease: Lease) -> None:
        self.active[lease.lease_id] = lease
        self.push_expiry(lease)

    def push_expiry(self, lease: Lease) -> None:
        lease.expiry_seq = next(self._seq)
        heapq.heappush(self.expiries, (lease.expire_time, lease.expiry_seq, lease.lease_id))

    def _ended_now(self, lease: Lease) -> None:
        lease.ended_time = time.time()
        self.releasing.pop(lease.lease_id, None)
        self.ended.append(lease)

    def _forget_request(self, lease: Lease) -> None:
        # Kept while the lease lives (a retry returns it); a finished one is not reused.
        if lease.request_id and self.by_request.get(lease.request_id) is lease:
            del self.by_request[lease.request_id]

    # -- shared by the parts --------------------------------------------------------------
    def check_drained(self, node: Node) -> None:
        if node.state is NodeState.DRAINING and not node.leases and not node.spares:
            node.state = NodeState.DRAINED
            self.update_node_metrics()

    def global_free(self) -> float:
        """Room left under max_leases (every sandbox on a node not lost counts)."""
        cap = self.settings.max_leases
        if not cap:
            return float("inf")
        used = sum(n.used for n in self.nodes.values() if not n.lost)
        return cap - used

    def update_lease_metrics(self) -> None:
        metrics.LEASES.labels(ACTIVE).set(len(self.active))
        metrics.LEASES.labels(PENDING).set(len(self.queue))

    def update_node_metrics(self) -> None:
        counts = dict.fromkeys(NodeState, 0)
        for node in self.nodes.values():
            counts[node.state] += 1
            metrics.NODE_HEALTHY.labels(node.node_id).set(
                1 if node.state is NodeState.HEALTHY else 0
            )
        for state, count in counts.items():
            metrics.NODES.labels(state).set(count)
