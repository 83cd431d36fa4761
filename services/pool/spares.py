"""Warm spares: sandboxes made ahead of demand (Prewarm targets), bound to a lease on acquire.

A spare holds its node's room from its creation until its destroy is confirmed. Requests waiting
come first: spares are made only while nothing is queued, and an idle one is given back when a
request waits for room. Targets are stored, so a restarted pool keeps making them.
"""

from __future__ import annotations

import time
import uuid

import structlog

from swerl.pool import metrics, placement
from swerl.pool.errors import InvalidLeaseRequest, NodeImageMissing, NodeSandboxGone
from swerl.pool.model import (
    LABEL_SPARE,
    LABEL_SPEC,
    SPARE_OWNER,
    Node,
    NodeState,
    Spare,
    Spec,
    Target,
    image_names,
)
from swerl.pool.state import PoolState
from swerl.pool.store import PoolStore, StoredTarget

log = structlog.get_logger("swerl.pool")


class Spares:
    def __init__(self, state: PoolState, store: PoolStore | None) -> None:
        self._state = state
        self._settings = state.settings
        self._store = store

    def load_targets(self) -> None:
        if self._store is not None:
            for row in self._store.targets():
                spec = Spec(**row.spec)
                self._state.targets[(row.image, row.spec_key)] = Target(row.image, spec, row.count)

    def prewarm(self, image: str, count: int, spec: Spec) -> tuple[int, int]:
        if not image:
            raise InvalidLeaseRequest("image is required")
        if count < 0:
            raise InvalidLeaseRequest("count cannot be negative")
        key = spec.key()
        targets = self._state.targets
        if count > 0:
            placement.check_image(image, {}, self._state.nodes)
            targets[(image, key)] = Target(image, spec, count)
        else:
            targets.pop((image, key), None)
        if self._store is not None:
            self._store.put_target(StoredTarget(image, key, spec.as_dict(), count))
        self._state.maintain_now.set()
        return self.counts(image, key)

    def counts(self, image: str, key: str) -> tuple[int, int]:
        """(ready, pending) spares of an image and spec key."""
        ready = pending = 0
        for node in self._state.nodes.values():
            for spare in node.spares.values():
                if spare.image == image and spare.spec_key == key:
                    if spare.ready and not spare.destroying:
                        ready += 1
                    else:
                        pending += 1
        return ready, pending

    def tend(self) -> None:
        """Renews spares nearing their expiry, destroys unwanted ones, makes missing ones."""
        state = self._state
        spawn = state.spawn
        now = time.time()
        have: dict[tuple[str, str], list[Spare]] = {}
        for node in state.nodes.values():
            for spare in list(node.spares.values()):
                if spare.destroying:
                    if not spare.busy:
                        spawn(self.destroy(node, spare))
                    continue
                key = (spare.image, spare.spec_key)
                if key not in state.targets or node.state is not NodeState.HEALTHY:
                    if node.state in (NodeState.HEALTHY, NodeState.DRAINING):
                        spawn(self.destroy(node, spare))
                    continue
                have.setdefault(key, []).append(spare)
                if (
                    spare.ready
                    and not spare.busy
                    and spare.expire_time - now < self._settings.spare_ttl_s / 2
                ):
                    spawn(self._renew(node, spare))
        # Requests waiting come first: spares are only made with room to spare.
        if state.queue:
            idle = [s for spares in have.values() for s in spares if s.ready and not s.busy]
            if idle:
                spare = idle[0]
                spawn(self.destroy(state.nodes[spare.node_id], spare))
            return
        free = state.global_free()
        for key, target in state.targets.items():
            spares = have.get(key, [])
            missing = target.count - len(spares)
            for spare in spares[target.count :]:
                if spare.ready and not spare.busy:
                    spawn(self.destroy(state.nodes[spare.node_id], spare))
            while missing > 0 and free > 0:
                chosen = placement.node_for_spare(target.image, state.index)
                if chosen is None:
                    break
                spare = Spare("spr-" + uuid.uuid4().hex[:20], chosen.node_id, target.image, key[1])
                spare.busy = True
                chosen.put_spare(spare)
                spawn(self._create(chosen, spare, target))
                missing -= 1
                free -= 1

    async def _create(self, node: Node, spare: Spare, target: Target) -> None:
        labels = {**target.spec.labels, LABEL_SPARE: spare.spare_id, LABEL_SPEC: spare.spec_key}
        try:
            facts = await node.conn.create(
                target.spec.create_request(
                    request_id=spare.spare_id,
                    image=target.image,
                    ttl_s=self._settings.spare_ttl_s,
                    owner=SPARE_OWNER,
                    labels=labels,
                )
            )
        except Exception as exc:
            node.pop_spare(spare.spare_id)
            if isinstance(exc, NodeImageMissing):
                node.images -= set(image_names(target.image))
            log.warning("pool.spare_failed", node_id=node.node_id, error=str(exc))
            self._state.pump()
            return
        spare.sandbox_id, spare.expire_time, spare.busy = facts.sandbox_id, facts.expire_time, False
        if spare.spare_id not in node.spares:
            node.put_spare(spare)  # Count it until its destroy is confirmed.
            spare.destroying = True
            await self.destroy(node, spare)
            return
        spare.ready = True
        metrics.SPARES.inc()
        self._state.pump()

    async def _renew(self, node: Node, spare: Spare) -> None:
        spare.busy = True
        try:
            spare.expire_time = await node.conn.renew(spare.sandbox_id, self._settings.spare_ttl_s)
        except NodeSandboxGone:
            node.pop_spare(spare.spare_id)
        except Exception:
            pass
        finally:
            spare.busy = False

    async def destroy(self, node: Node, spare: Spare) -> None:
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
        self._state.check_drained(node)
        self._state.pump()
