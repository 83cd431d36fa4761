"""An in-process exec node behind the pool's `NodeConnection` Protocol, for control-plane tests
and the 1,000-node benchmark: sandboxes are dict entries, so only the pool's own work is measured.

`down = True` makes every call fail as unreachable and breaks the health watch, as a killed node
would; `fail_destroy = True` makes destroys fail while the node stays up.

Images: a node pulls from a `SimulatedRegistry` (image name -> size; `down`, `auth_failure` and
`cut_pulls` make pulls fail as a real node reports it), one pull at a time over a link of
`pull_bytes_per_s`, into an image cache bounded by `image_budget_bytes` that evicts the least
recently used images no sandbox runs from, as the exec node's cache does.

A renewal only stores a float (`expire_times`): a real node keeps its sandboxes in another
process, so renewing thousands a second must not fill the pool process with new objects (which
its garbage collector would then have to walk).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import replace

from swerl.pool.errors import (
    NodeFull,
    NodeImageMissing,
    NodeRejected,
    NodeSandboxGone,
    NodeUnreachable,
)
from swerl.pool.nodes import (
    CreateRequest,
    ForkFacts,
    ForkRequest,
    NodeFacts,
    NodeImages,
    PullOutcome,
    PullProgress,
    SandboxFacts,
)


class SimulatedRegistry:
    """What simulated nodes pull from: image name -> size in bytes."""

    def __init__(self, images: dict[str, int] | None = None) -> None:
        self.images: dict[str, int] = dict(images or {})
        self.down = False
        self.auth_failure = False
        self.cut_pulls = 0  # the next this many pulls break off (PULL_FAILED)


class SimulatedNode:
    def __init__(
        self,
        node_id: str,
        *,
        capacity: int = 64,
        images: Iterable[str] = ("swerl-base:bookworm",),
        create_latency_s: float = 0.0,
        registry: SimulatedRegistry | None = None,
        image_budget_bytes: int = 0,
        pull_bytes_per_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self.capacity = capacity
        self.registry = registry or SimulatedRegistry()
        self.image_names = set(images)
        # When each image was last used (LRU eviction) and what it takes on disk.
        self.clock = clock
        self.last_used: dict[str, float] = dict.fromkeys(self.image_names, 0.0)
        self.image_budget_bytes = image_budget_bytes
        self.pull_bytes_per_s = pull_bytes_per_s
        self.pulled_bytes = 0
        self.pulled: list[str] = []  # images in the order their pulls finished
        self.evicted = 0
        self.max_used_bytes = self.used_bytes
        self.create_latency_s = create_latency_s
        self._link = asyncio.Lock()  # one pull at a time over the node's link
        self.sandboxes: dict[str, SandboxFacts] = {}
        # The current expiry of each sandbox; its facts' expire_time is the one at create/bind.
        self.expire_times: dict[str, float] = {}
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
        return NodeFacts(
            self.node_id,
            self.capacity,
            len(self.sandboxes),
            "sim",
            True,
            "",
            self.image_budget_bytes,
            self.used_bytes,
        )

    @property
    def used_bytes(self) -> int:
        return sum(self.registry.images.get(name, 0) for name in self.image_names)

    async def images(self) -> NodeImages:
        self._enter("images")
        return NodeImages(set(self.image_names), self.used_bytes)

    async def pull(self, image: str, on_progress: Callable[[PullProgress], None]) -> PullOutcome:
        self._enter("pull")
        if image in self.image_names:
            return PullOutcome("PRESENT")
        registry = self.registry
        if registry.down:
            return PullOutcome("FAILED", "REGISTRY_UNREACHABLE", "dial tcp: connection refused")
        if registry.auth_failure:
            return PullOutcome("FAILED", "REGISTRY_AUTH", "unauthorized: authentication required")
        size = registry.images.get(image)
        if size is None:
            return PullOutcome("FAILED", "IMAGE_NOT_FOUND", f"manifest for {image} not found")
        if self.image_budget_bytes and size > self.image_budget_bytes:
            return PullOutcome(
                "FAILED", "IMAGE_TOO_LARGE", f"{size} bytes > budget {self.image_budget_bytes}"
            )
        async with self._link:
            if registry.cut_pulls > 0:
                registry.cut_pulls -= 1
                return PullOutcome("FAILED", "PULL_FAILED", "unexpected EOF")
            if self.pull_bytes_per_s:
                on_progress(PullProgress("Downloading", 0, size))
                await asyncio.sleep(size / self.pull_bytes_per_s)
            on_progress(PullProgress("Download complete", size, size))
            self._make_room(size)
            self.image_names.add(image)
            self.last_used[image] = self.clock()
            self.pulled_bytes += size
            self.pulled.append(image)
            self.max_used_bytes = max(self.max_used_bytes, self.used_bytes)
        return PullOutcome("PULLED")

    def _make_room(self, size: int) -> None:
        """Evicts least recently used images no sandbox runs from until `size` fits."""
        if not self.image_budget_bytes:
            return
        in_use = {facts.image for facts in self.sandboxes.values()}
        for name in sorted(self.image_names, key=lambda n: self.last_used.get(n, 0.0)):
            if self.used_bytes + size <= self.image_budget_bytes:
                return
            if name not in in_use:
                self.image_names.discard(name)
                self.last_used.pop(name, None)
                self.evicted += 1

    async def create(self, request: CreateRequest) -> SandboxFacts:
        self._enter("create")
        existing = self._by_request.get(request.request_id)
        if existing in self.sandboxes:
            return self._current(existing)
        if request.image not in self.image_names:
            raise NodeImageMissing(f"{request.image} not on {self.node_id}")
        if len(self.sandboxes) >= self.capacity:
            raise NodeFull(f"{self.node_id} is full")
        if request.ttl_s < 0:
            raise NodeRejected("bad ttl", code="INVALID_ARGUMENT", reason="INVALID_SANDBOX_SPEC")
        self.last_used[request.image] = self.clock()
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
        self.expire_times[facts.sandbox_id] = facts.expire_time
        self._by_request[request.request_id] = facts.sandbox_id
        return facts

    def _current(self, sandbox_id: str) -> SandboxFacts:
        facts = self.sandboxes[sandbox_id]
        expire_time = self.expire_times.get(sandbox_id, facts.expire_time)
        if facts.expire_time == expire_time:
            return facts
        return replace(facts, expire_time=expire_time)

    def _replace(self, sandbox_id: str, **changes) -> SandboxFacts:
        old = self.sandboxes.get(sandbox_id)
        if old is None:
            raise NodeSandboxGone(f"no sandbox {sandbox_id} on {self.node_id}")
        facts = replace(old, **changes)
        self.sandboxes[sandbox_id] = facts
        self.expire_times[sandbox_id] = facts.expire_time
        return facts

    async def fork(self, request: ForkRequest) -> ForkFacts:
        """Copies of the source's facts under the new lease ids (no filesystem to copy)."""
        self._enter("fork")
        source = self._current(request.sandbox_id) if request.sandbox_id in self.sandboxes else None
        if source is None:
            raise NodeSandboxGone(f"no sandbox {request.sandbox_id} on {self.node_id}")
        made = []
        for index, lease_id in enumerate(request.lease_ids):
            made.append(
                await self.create(
                    CreateRequest(
                        request_id=f"{request.request_id}/fork/{index}",
                        image=source.image,
                        ttl_s=request.ttl_s,
                        lease_id=lease_id,
                        owner=request.owner or source.owner,
                        instance_id=source.instance_id,
                        labels={**source.labels, **request.labels},
                    )
                )
            )
        return ForkFacts("ckp-sim-" + uuid.uuid4().hex[:12], tuple(made))

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
        if sandbox_id not in self.sandboxes:
            raise NodeSandboxGone(f"no sandbox {sandbox_id} on {self.node_id}")
        expire_time = self.expire_times[sandbox_id] = time.time() + ttl_s
        return expire_time

    async def destroy(self, sandbox_id: str) -> bool:
        self._enter("destroy")
        if self.fail_destroy:
            raise NodeUnreachable(f"simulated destroy failure on {self.node_id}")
        self.expire_times.pop(sandbox_id, None)
        return self.sandboxes.pop(sandbox_id, None) is not None

    async def list_sandboxes(self) -> list[SandboxFacts]:
        self._enter("list")
        return [self._current(sandbox_id) for sandbox_id in self.sandboxes]

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
