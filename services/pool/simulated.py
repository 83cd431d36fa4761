"""An in-process exec node behind the pool's `NodeConnection` Protocol, for control-plane tests
and the 1,000-node benchmark: sandboxes are dict entries, so only the pool's own work is measured.

`down = True` makes every call fail as unreachable and breaks the health watch, as a killed node
would; `fail_destroy = True` makes destroys fail while the node stays up.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable

from swerl.pool.errors import (
    NodeFull,
    NodeImageMissing,
    NodeRejected,
    NodeSandboxGone,
    NodeUnreachable,
)
from swerl.pool.nodes import CreateRequest, NodeFacts, SandboxFacts


class SimulatedNode:
    def __init__(
        self,
        node_id: str,
        *,
        capacity: int = 64,
        images: Iterable[str] = ("swerl-base:bookworm",),
        create_latency_s: float = 0.0,
    ) -> None:
        self.node_id = node_id
        self.capacity = capacity
        self.image_names = set(images)
        self.create_latency_s = create_latency_s
        self.sandboxes: dict[str, SandboxFacts] = {}
        self._by_request: dict[str, str] = {}
        self.down = False
        self.fail_destroy = False
        self.calls: dict[str, int] = {}
        self._changed = asyncio.Event()

    def _enter(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.down:
            raise NodeUnreachable(f"simulated node {self.node_id} is down")

    def set_down(self, down: bool) -> None:
        self.down = down
        self._changed.set()

    async def info(self) -> NodeFacts:
        self._enter("info")
        return NodeFacts(self.node_id, self.capacity, len(self.sandboxes), "sim", True, "")

    async def images(self) -> set[str]:
        self._enter("images")
        return set(self.image_names)

    async def create(self, request: CreateRequest) -> SandboxFacts:
        self._enter("create")
        existing = self._by_request.get(request.request_id)
        if existing in self.sandboxes:
            return self.sandboxes[existing]
        if request.image not in self.image_names:
            raise NodeImageMissing(f"{request.image} not on {self.node_id}")
        if len(self.sandboxes) >= self.capacity:
            raise NodeFull(f"{self.node_id} is full")
        if request.ttl_s < 0:
            raise NodeRejected("bad ttl", code="INVALID_ARGUMENT", reason="INVALID_SANDBOX_SPEC")
        if self.create_latency_s:
            await asyncio.sleep(self.create_latency_s)
        facts = SandboxFacts(
            sandbox_id="sbx-" + uuid.uuid4().hex[:20],
            image=request.image,
            lease_id=request.lease_id,
            owner=request.owner,
            instance_id=request.instance_id,
            expire_time=time.time() + request.ttl_s,
            running=True,
            labels=dict(request.labels),
        )
        self.sandboxes[facts.sandbox_id] = facts
        self._by_request[request.request_id] = facts.sandbox_id
        return facts

    def _replace(self, sandbox_id: str, **changes) -> SandboxFacts:
        old = self.sandboxes.get(sandbox_id)
        if old is None:
            raise NodeSandboxGone(f"no sandbox {sandbox_id} on {self.node_id}")
        fields = {**old.__dict__, **changes}
        facts = SandboxFacts(**fields)
        self.sandboxes[sandbox_id] = facts
        return facts

    async def bind(
        self, sandbox_id: str, lease_id: str, owner: str, instance_id: str, ttl_s: float
    ) -> SandboxFacts:
        self._enter("bind")
        return self._replace(
            sandbox_id,
            lease_id=lease_id,
            owner=owner,
            instance_id=instance_id,
            expire_time=time.time() + ttl_s,
        )

    async def renew(self, sandbox_id: str, ttl_s: float) -> float:
        self._enter("renew")
        return self._replace(sandbox_id, expire_time=time.time() + ttl_s).expire_time

    async def destroy(self, sandbox_id: str) -> bool:
        self._enter("destroy")
        if self.fail_destroy:
            raise NodeUnreachable(f"simulated destroy failure on {self.node_id}")
        return self.sandboxes.pop(sandbox_id, None) is not None

    async def list_sandboxes(self) -> list[SandboxFacts]:
        self._enter("list")
        return list(self.sandboxes.values())

    async def watch_health(self) -> AsyncIterator[bool]:
        self._enter("watch")
        while True:
            self._changed.clear()
            if self.down:
                raise NodeUnreachable(f"simulated node {self.node_id} went away")
            yield True
            await self._changed.wait()

    async def close(self) -> None:
        pass
