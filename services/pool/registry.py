"""The nodes the pool places on: registration, health, drain, and adoption of what they hold.

The nodes' labelled sandboxes are the truth: whenever a node is (re)synced, the pool adopts the
leases and spares it finds there and ends what it no longer has, which is also how a restarted
pool rebuilds its lease table. A node's health is watched on one stream per node; after
health_failure_threshold failures in a row its ACTIVE leases are reported lost. Which nodes
registered (and whether an operator drained them) is stored, so a restarted pool knows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping

import structlog

from swerl.pool.errors import (
    InvalidNode,
    NodeIdMismatch,
    NodeNotFound,
    NodeRejected,
    NodeSandboxGone,
    NodeUnreachable,
)
from swerl.pool.keepalive import Tokens
from swerl.pool.model import (
    LABEL_REQUEST,
    LABEL_SPARE,
    LABEL_SPEC,
    LABEL_TTL,
    Lease,
    LeaseState,
    LossReason,
    Node,
    NodeState,
    Spare,
    Spec,
)
from swerl.pool.nodes import NodeConnection, NodeImages, SandboxFacts
from swerl.pool.spares import Spares
from swerl.pool.state import PoolState
from swerl.pool.store import PoolStore, StoredNode

log = structlog.get_logger("swerl.pool")

ACTIVE, RELEASING = LeaseState.ACTIVE, LeaseState.RELEASING
PENDING, HEALTHY, UNHEALTHY = NodeState.PENDING, NodeState.HEALTHY, NodeState.UNHEALTHY
DRAINING, DRAINED = NodeState.DRAINING, NodeState.DRAINED


def parse_static_node(text: str) -> tuple[str, str]:
    """ "node_id=host:port" -> (node_id, address); a bare address has no id yet ("")."""
    node_id, sep, address = text.partition("=")
    return (node_id.strip(), address.strip()) if sep else ("", text.strip())


class NodeRegistry:
    def __init__(
        self,
        state: PoolState,
        connect: Callable[[str], NodeConnection],
        store: PoolStore | None,
        tokens: Tokens,
        spares: Spares,
    ) -> None:
        self._state = state
        self._settings = state.settings
        self._connect = connect
        self._store = store
        self._tokens = tokens
        self._spares = spares

    async def load(self) -> None:
        """Re-adds the stored and the static nodes, then syncs the known ones before the pool
        answers anyone: a holder renewing right after a restart must find its lease adopted,
        not be told it does not exist."""
        if self._store is not None:
            for stored in self._store.nodes():
                node = self._add(stored.node_id, stored.address, stored.capacity, stored.labels)
                if stored.drained:
                    node.state = DRAINING
        for text in self._settings.nodes:
            node_id, address = parse_static_node(text)
            if node_id and node_id not in self._state.nodes:
                self._add(node_id, address, 0, {})
            elif not node_id:
                self._state.spawn(self._register_static(address))
        await self._initial_sync()

    async def _initial_sync(self) -> None:
        async def one(node: Node) -> None:
            try:
                await self.sync(node)
            except Exception as exc:  # Down or refusing: its health loop keeps trying.
                log.warning("pool.initial_sync_failed", node_id=node.node_id, error=str(exc))

        nodes = [n for n in self._state.nodes.values() if n.state is not DRAINED]
        if nodes:
            await asyncio.wait(
                [asyncio.ensure_future(one(n)) for n in nodes],
                timeout=self._settings.initial_sync_timeout_s,
            )

    def health_tasks(self) -> list[asyncio.Task[None]]:
        return [n.health_task for n in self._state.nodes.values() if n.health_task is not None]

    async def close(self) -> None:
        for node in self._state.nodes.values():
            with contextlib.suppress(Exception):
                await node.conn.close()

    def _add(
        self,
        node_id: str,
        address: str,
        capacity: int,
        labels: Mapping[str, str],
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
        self._state.nodes[node_id] = node
        self._state.index.add(node)
        node.health_task = asyncio.get_running_loop().create_task(
            self._health_loop(node), name=f"pool.health.{node_id}"
        )
        self._state.update_node_metrics()
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
                    await asyncio.sleep(self._settings.health_retry_interval_s * 4)
        finally:
            await conn.close()
        if facts.node_id not in self._state.nodes:
            self._add(facts.node_id, address, 0, {})

    async def register(
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
        node = self._state.nodes.get(node_id)
        if node is None:
            node = self._add(node_id, address, capacity, labels, conn)
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
            if node.state in (DRAINING, DRAINED):
                node.state = PENDING
        self._persist(node)
        try:
            await self.sync(node)
        except (NodeUnreachable, NodeRejected) as exc:
            raise NodeUnreachable(
                f"node {address} failed to sync: {exc}", address=address
            ) from None
        if node.state in (PENDING, UNHEALTHY) and node.failures == 0:
            node.state = HEALTHY
        self._state.update_node_metrics()
        self._state.pump()
        return node

    def _persist(self, node: Node) -> None:
        if self._store is not None:
            self._store.put_node(
                StoredNode(
                    node.node_id,
                    node.address,
                    node.asked_capacity,
                    node.labels,
                    node.state in (DRAINING, DRAINED),
                )
            )

    async def drain(self, node_id: str, evict: bool) -> Node:
        state = self._state
        node = state.nodes.get(node_id)
        if node is None:
            raise NodeNotFound(f"no node {node_id!r}", node_id=node_id)
        if node.state is not DRAINED:
            node.state = DRAINING
        self._persist(node)
        for spare in list(node.spares.values()):
            state.spawn(self._spares.destroy(node, spare))
        if evict:
            for lease_id in list(node.leases):
                lease = state.leases[lease_id]
                if lease.state is ACTIVE:
                    state.end(lease, LossReason.REVOKED, f"node {node_id} drained with evict")
        state.check_drained(node)
        state.update_node_metrics()
        return node

    async def _health_loop(self, node: Node) -> None:
        state = self._state
        while True:
            try:
                async for serving in node.conn.watch_health():
                    if not serving:
                        self._health_failed(node, "node reports NOT_SERVING")
                        continue
                    if node.state in (PENDING, UNHEALTHY) or node.lost:
                        await self.sync(node)
                    node.failures, node.health_message, node.lost = 0, "", False
                    node.last_seen = time.time()
                    if node.state in (PENDING, UNHEALTHY):
                        node.state = HEALTHY
                        log.info("pool.node_healthy", node_id=node.node_id)
                        state.update_node_metrics()
                        state.pump()
                        state.maintain_now.set()
            except asyncio.CancelledError:
                raise
            except (NodeUnreachable, NodeRejected, NodeIdMismatch) as exc:
                self._health_failed(node, str(exc))
            except Exception as exc:
                log.exception("pool.health_loop_error", node_id=node.node_id)
                self._health_failed(node, repr(exc))
            await asyncio.sleep(self._settings.health_retry_interval_s)

    def _health_failed(self, node: Node, message: str) -> None:
        state = self._state
        node.failures += 1
        node.health_message = message
        if node.state in (PENDING, HEALTHY):
            node.state = UNHEALTHY
            state.update_node_metrics()
        if node.failures >= self._settings.health_failure_threshold and not node.lost:
            node.lost = True
            log.warning("pool.node_lost", node_id=node.node_id, message=message)
            for lease_id in list(node.leases):
                lease = state.leases[lease_id]
                if lease.state is ACTIVE:
                    state.end(lease, LossReason.NODE_LOST, f"node {node.node_id} lost: {message}")
            state.pump()  # The global cap no longer counts a lost node.

    async def sync(self, node: Node) -> None:
        """Reads the node's capacity, images and sandboxes, and adopts or ends leases to match."""
        async with node.sync_lock:
            facts = await node.conn.info()
            if facts.node_id != node.node_id:
                raise NodeIdMismatch(
                    f"node at {node.address} now reports node_id {facts.node_id!r}",
                    node_id=node.node_id,
                )
            node.node_capacity, node.version = facts.capacity, facts.version
            node.image_budget_bytes = facts.image_budget_bytes
            self._set_images(node, await node.conn.images(), facts.image_used_bytes)
            sandboxes = await node.conn.list_sandboxes()
            self._adopt(node, sandboxes)

    async def refresh_images(self, node: Node) -> None:
        with contextlib.suppress(Exception):
            self._set_images(node, await node.conn.images())
            self._state.pump()

    @staticmethod
    def _set_images(node: Node, images: NodeImages, used_bytes: int = 0) -> None:
        node.images, node.images_time = images.names, time.time()
        # The node's own count of its cache wins; else what its listed images add up to.
        node.image_used_bytes = used_bytes or images.size_bytes

    def _adopt(self, node: Node, sandboxes: Iterable[SandboxFacts]) -> None:
        state = self._state
        now = time.time()
        seen: set[str] = set()
        adopted = strays = 0
        for sb in sandboxes:
            seen.add(sb.sandbox_id)
            if sb.lease_id:
                lease = state.leases.get(sb.lease_id)
                if lease is None:
                    if not sb.running:
                        state.spawn(self._destroy_stray(node, sb.sandbox_id))
                        continue
                    self._adopt_lease(node, sb, now)
                    adopted += 1
                elif lease.node_id == node.node_id and lease.sandbox_id in ("", sb.sandbox_id):
                    if lease.sandbox_id and lease.state is ACTIVE:
                        lease.node_expire_time = sb.expire_time
                else:  # A copy from a create whose reply was lost, or a lease that moved.
                    strays += 1
                    state.spawn(self._destroy_stray(node, sb.sandbox_id))
            elif LABEL_SPARE in sb.labels:
                spare_id = sb.labels[LABEL_SPARE]
                spare = node.spares.get(spare_id)
                if spare is not None and spare.sandbox_id in ("", sb.sandbox_id):
                    continue
                spec_key = sb.labels.get(LABEL_SPEC, "")
                if not sb.running or (sb.image, spec_key) not in state.targets:
                    strays += 1
                    state.spawn(self._destroy_stray(node, sb.sandbox_id))
                    continue
                node.put_spare(
                    Spare(
                        spare_id,
                        node.node_id,
                        sb.image,
                        spec_key,
                        sb.sandbox_id,
                        sb.expire_time,
                        ready=True,
                    )
                )
        for lease_id in list(node.leases):
            lease = state.leases[lease_id]
            if not lease.sandbox_id or lease.sandbox_id in seen:
                continue
            # The node says the sandbox is gone: that is its destroy confirmation.
            if lease.state is ACTIVE:
                state.end(
                    lease,
                    LossReason.SANDBOX_LOST,
                    "the node no longer has the sandbox",
                    destroy=False,
                )
            if lease.state is RELEASING:
                state.finish(lease)
        for spare_id, spare in list(node.spares.items()):
            if spare.sandbox_id and spare.sandbox_id not in seen:
                node.pop_spare(spare_id)
        if adopted or strays:
            log.info("pool.node_synced", node_id=node.node_id, adopted=adopted, strays=strays)
        state.check_drained(node)
        state.update_lease_metrics()

    def _adopt_lease(self, node: Node, sb: SandboxFacts, now: float) -> None:
        slack = self._settings.node_expiry_slack_s
        ttl = float(sb.labels.get(LABEL_TTL, "0") or 0) or self._settings.default_ttl_s
        # The lease ran until about node expiry - slack, but its holder could not renew with
        # the pool while the pool was away (and cannot before the restarted pool serves): its
        # time does not run meanwhile. It gets a whole TTL from now to reconnect (at least the
        # adoption grace: a holder retries with backoff, and a short TTL is shorter than that),
        # bounded at first by the node's own expiry (which the holder kept moving on the node,
        # see swerl.pool.client) until the renewal below moves that too.
        reconnect = max(ttl, self._settings.adopt_grace_s)
        expire = max(sb.expire_time - slack, min(sb.expire_time, now + reconnect))
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
        self._tokens.issue(lease, ttl)
        self._state.admit(lease)
        if expire < now + reconnect:
            self._state.spawn(self._renew_adopted(node, lease, now + reconnect))

    async def _renew_adopted(self, node: Node, lease: Lease, expire: float) -> None:
        """Moves an adopted lease's expiry to `expire`, once the node keeps its sandbox that
        long; a node that does not answer keeps the expiry it reported."""
        slack = self._settings.node_expiry_slack_s
        try:
            node_expire = await node.conn.renew(lease.sandbox_id, expire - time.time() + slack)
        except (NodeUnreachable, NodeRejected, NodeSandboxGone) as exc:
            log.warning("pool.adopted_renew_failed", lease_id=lease.lease_id, error=str(exc))
            return
        if lease.state is not ACTIVE:
            return
        lease.node_expire_time = node_expire
        wanted = min(expire, node_expire)
        if wanted > lease.expire_time:  # An expiry only ever moves later.
            lease.expire_time = wanted
            self._tokens.issue(lease, lease.ttl_s)

    async def _destroy_stray(self, node: Node, sandbox_id: str) -> None:
        with contextlib.suppress(Exception):
            await node.conn.destroy(sandbox_id)
