"""The exec node's domain: sandboxes on the local dockerd, their commands, diffs and images.

Every container swerl creates carries labels (node, sandbox id, image, owner, lease, instance,
initial expiry) so nothing swerl made is ever unaccounted for; the renewable expiry and the
idempotency keys live in the node's SQLite store. On start the node adopts the labelled
containers that are still valid and removes the rest, and a reaper destroys sandboxes past their
expiry, so neither a node restart nor a dead client leaks a container for longer than one TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

import swerl
from swerl.chassis.capability import check as check_capability
from swerl.exec.bundles import BUNDLE_MOUNT
from swerl.exec.commands import check_command, with_node_defaults
from swerl.exec.diff import DiffResult, git_diff
from swerl.exec.errors import ImageNotPresent, InvalidSandboxSpec, NodeAtCapacity, SandboxNotFound
from swerl.exec.health import DockerHealth
from swerl.exec.image_ensure import ImageEvent, ensure_images, validate_image_reference
from swerl.exec.images import CachedImage, ImageCache
from swerl.exec.labels import ENV_LABEL, LABEL_PREFIX, USER_LABEL
from swerl.exec.reaper import SandboxReaper
from swerl.exec.runtime import ContainerRuntime, ContainerSpec
from swerl.exec.settings import ExecSettings
from swerl.exec.shell import CONTAINER_IO_DIR, CommandRun, CommandSpec, SandboxShell, ensure_io_dir
from swerl.exec.store import NodeStore, StoredSandbox

log = structlog.get_logger(__name__)

# The networks a sandbox can have.
NETWORK_MODES = ("none", "bridge", "host")


@dataclass
class Resources:
    cpus: float
    memory_bytes: int
    pids: int


@dataclass
class CreateSpec:
    image: str
    request_id: str = ""
    workdir: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    resources: Resources | None = None
    network: str = "none"
    labels: Mapping[str, str] = field(default_factory=dict)
    ttl_s: float = 0.0
    lease_id: str = ""
    owner: str = ""
    instance_id: str = ""
    # Set only by the node's evaluator, never from a request: lets evaluation sandboxes have the
    # bridge network when ExecSettings.evaluation_network is on, whatever allow_bridge_network.
    for_evaluation: bool = False
    # Set only by the node's fork code (swerl.exec.forks), never from a request: the checkpoint
    # the sandbox starts from and the node-local image that holds it (`image` stays the task's).
    checkpoint_id: str = ""
    from_image: str = ""


@dataclass
class SandboxRecord:
    sandbox_id: str
    container_id: str
    image: str
    workdir: str
    env: dict[str, str]
    labels: dict[str, str]
    create_time: float
    expire_time: float
    lease_id: str
    owner: str
    instance_id: str
    resources: Resources
    network: str
    request_id: str
    shell: SandboxShell
    # As Docker last told (GetSandbox and ListSandboxes ask it afresh): a container that stopped
    # is started again by its next command unless the sandbox is lost (shell.lost).
    running: bool = True
    destroying: asyncio.Future[bool] | None = None
    # When this node started tracking the sandbox (its container exists from then on).
    tracked_since: float = field(default_factory=time.time)
    # The checkpoint (fork image) the sandbox was created from, if any.
    checkpoint_id: str = ""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    version: str
    capacity: int
    running: int
    docker_healthy: bool
    docker_version: str
    docker_error: str
    cpus: int
    memory_bytes: int
    image_budget_bytes: int
    image_used_bytes: int
    images_cached: int


class SandboxManager:
    def __init__(
        self,
        settings: ExecSettings,
        backend: ContainerRuntime,
        store: NodeStore,
        *,
        on_docker_health: Callable[[bool], None] | None = None,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.store = store
        self._records: dict[str, SandboxRecord] = {}
        self._by_request: dict[str, str] = {}
        self._creating: dict[str, asyncio.Future[SandboxRecord]] = {}
        self._pending_creates = 0
        # Images of the creates under way: in use before their container exists.
        self._creating_images: Counter[str] = Counter()
        self._tasks: list[asyncio.Task[None]] = []
        # dockerd's health (swerl.exec.health) and the housekeeping rounds (swerl.exec.reaper).
        self.health = DockerHealth(
            backend,
            settings.docker_health_interval_s,
            on_docker_health,
            ping_timeout_s=settings.docker_ping_timeout_s,
        )
        self.reaper = SandboxReaper(
            settings, backend, lambda: list(self._records.values()), self.destroy
        )
        self.images = ImageCache(settings, backend, store, self._images_in_use)
        # Called with each destroyed sandbox (swerl.exec.forks frees fork images it held).
        self.after_destroy: list[Callable[[SandboxRecord], None]] = []

    def _images_in_use(self) -> Iterator[str]:
        """The image of every sandbox, running, spare or being created (one entry each)."""
        for record in self._records.values():
            yield record.image
        yield from self._creating_images.elements()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.health.version = await self.backend.ping()
        await self.reconcile()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.reaper.run(), name="exec.reaper"),
            loop.create_task(self.health.run(), name="exec.docker-health"),
        ]

    async def stop(self) -> None:
        """Stops background work; sandboxes stay (the next start adopts them)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for record in self._records.values():
            await record.shell.close()
        # The containers outlive this manager, but it no longer speaks for them (its Docker
        # backend and store close next): only the next start's reconcile takes them back.
        self._records.clear()
        self._by_request.clear()

    async def reconcile(self) -> None:
        """Adopts valid labelled containers of this node and removes expired or stopped ones."""
        stored = self.store.all()
        bindings = self.store.bindings()
        now = time.time()
        found = await self.backend.list_labelled({LABEL_PREFIX + "node": self.settings.node_id})
        seen: set[str] = set()
        adopted = removed = 0
        for info in found:
            labels = info.labels
            sandbox_id = labels.get(LABEL_PREFIX + "sandbox_id", "")
            row = stored.get(sandbox_id)
            expire = (
                row.expire_time
                if row
                else float(labels.get(LABEL_PREFIX + "expire_time", "0") or 0)
            )
            if not sandbox_id or not info.running or expire <= now:
                await self.backend.remove(info.container_id)
                removed += 1
                continue
            seen.add(sandbox_id)
            record = self._record_from_labels(info.container_id, labels, expire)
            if sandbox_id in bindings:  # A spare handed to a lease after its creation.
                record.lease_id, record.owner, record.instance_id = bindings[sandbox_id]
            self._records[sandbox_id] = record
            # A command the previous node process left running has no caller any more.
            record.shell.end_orphan()
            if record.request_id:
                self._by_request[record.request_id] = sandbox_id
            if row is None:
                self.store.put(
                    StoredSandbox(sandbox_id, info.container_id, record.request_id, expire)
                )
            adopted += 1
        for sandbox_id in stored.keys() - seen:
            self.store.delete(sandbox_id)
        io_root = self.settings.state_dir / "io"
        if io_root.is_dir():
            for stale in io_root.iterdir():
                if stale.name not in seen:
                    shutil.rmtree(stale, ignore_errors=True)
        log.info("exec.reconciled", adopted=adopted, removed=removed)

    def _record_from_labels(
        self, container_id: str, labels: Mapping[str, str], expire: float
    ) -> SandboxRecord:
        user = {k[len(USER_LABEL) :]: v for k, v in labels.items() if k.startswith(USER_LABEL)}
        env = {k[len(ENV_LABEL) :]: v for k, v in labels.items() if k.startswith(ENV_LABEL)}
        return SandboxRecord(
            sandbox_id=labels[LABEL_PREFIX + "sandbox_id"],
            container_id=container_id,
            image=labels.get(LABEL_PREFIX + "image", ""),
            workdir=labels.get(LABEL_PREFIX + "workdir", ""),
            env=env,
            labels=user,
            create_time=float(labels.get(LABEL_PREFIX + "create_time", "0") or 0),
            expire_time=expire,
            lease_id=labels.get(LABEL_PREFIX + "lease_id", ""),
            owner=labels.get(LABEL_PREFIX + "owner", ""),
            instance_id=labels.get(LABEL_PREFIX + "instance_id", ""),
            resources=Resources(
                cpus=float(labels.get(LABEL_PREFIX + "cpus", "0") or 0),
                memory_bytes=int(labels.get(LABEL_PREFIX + "memory_bytes", "0") or 0),
                pids=int(labels.get(LABEL_PREFIX + "pids", "0") or 0),
            ),
            network=labels.get(LABEL_PREFIX + "network", "none"),
            request_id=labels.get(LABEL_PREFIX + "request_id", ""),
            checkpoint_id=labels.get(LABEL_PREFIX + "checkpoint_id", ""),
            shell=SandboxShell(
                self.backend, container_id, self.io_dir(labels[LABEL_PREFIX + "sandbox_id"]), env
            ),
        )

    def _bundle_root(self) -> Path:
        """The node's harness bundles (swerl.exec.bundles), read-only in every sandbox."""
        root = self.settings.bundle_dir
        root.mkdir(parents=True, exist_ok=True)
        return root

    def io_dir(self, sandbox_id: str) -> Path:
        return self.settings.state_dir / "io" / sandbox_id

    # -- queries --------------------------------------------------------------------------
    @property
    def live_count(self) -> int:
        return len(self._records) + self._pending_creates

    def get(self, sandbox_id: str) -> SandboxRecord:
        record = self._records.get(sandbox_id)
        if record is None or record.destroying is not None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id)
        return record

    def by_request_id(self, request_id: str) -> SandboxRecord | None:
        """The live sandbox a create with this request_id made, if any."""
        record = self._records.get(self._by_request.get(request_id, ""))
        return record if record is not None and record.destroying is None else None

    @property
    def checks_lease_tokens(self) -> bool:
        """Whether calls about a sandbox must carry a lease token (the node has a secret)."""
        return self.settings.capability_secret is not None

    def check_lease_token(self, sandbox_id: str, token: str | None) -> None:
        """Raises the chassis' LeaseToken* errors unless `token` was minted for `sandbox_id` and
        the lease bound to it; a no-op when the node has no capability secret."""
        secret = self.settings.capability_secret
        if secret is None:
            return
        record = self._records.get(sandbox_id)
        check_capability(
            secret.get_secret_value().encode(),
            token,
            sandbox_id=sandbox_id,
            bound_lease_id=record.lease_id if record is not None else None,
        )

    def list_sandboxes(self, selector: Mapping[str, str]) -> list[SandboxRecord]:
        """The sandboxes whose caller labels include every pair of `selector`."""
        return [
            r
            for r in self._records.values()
            if r.destroying is None and all(r.labels.get(k) == v for k, v in selector.items())
        ]

    async def observe(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox with its container's state as Docker tells it now (GetSandbox)."""
        record = self.get(sandbox_id)
        state = await self.backend.container_state(record.container_id)
        record.running = state is not None and state.running
        return record

    async def observe_all(self, selector: Mapping[str, str]) -> list[SandboxRecord]:
        """`list_sandboxes` with each container's state as Docker tells it now (one call)."""
        records = self.list_sandboxes(selector)
        if records:
            found = await self.backend.list_labelled({LABEL_PREFIX + "node": self.settings.node_id})
            running = {info.container_id for info in found if info.running}
            for record in records:
                record.running = record.container_id in running
        return records

    async def node_info(self) -> NodeInfo:
        cpus, memory = 0, 0
        with contextlib.suppress(Exception):
            cpus, memory = await self.backend.host_resources()
        usage = await self.images.usage()
        return NodeInfo(
            node_id=self.settings.node_id,
            version=swerl.__version__,
            capacity=self.settings.max_sandboxes,
            running=self.live_count,
            docker_healthy=self.health.healthy,
            docker_version=self.health.version,
            docker_error=self.health.error,
            cpus=cpus,
            memory_bytes=memory,
            image_budget_bytes=usage.budget_bytes,
            image_used_bytes=usage.used_bytes,
            images_cached=usage.cached_images,
        )

    # -- create / renew / destroy ---------------------------------------------------------
    def _validate(self, spec: CreateSpec) -> None:
        validate_image_reference(spec.image)
        if spec.workdir and not spec.workdir.startswith("/"):
            raise InvalidSandboxSpec(f"workdir must be absolute, got {spec.workdir!r}")
        if spec.ttl_s < 0 or spec.ttl_s > self.settings.max_ttl_s:
            raise InvalidSandboxSpec(
                f"ttl must be between 0 and {self.settings.max_ttl_s:g} s, got {spec.ttl_s:g}"
            )
        if spec.network not in NETWORK_MODES:
            raise InvalidSandboxSpec(f"unknown network {spec.network!r}")
        bridge_allowed = self.settings.allow_bridge_network or (
            spec.for_evaluation and self.settings.evaluation_network
        )
        if spec.network == "bridge" and not bridge_allowed:
            raise InvalidSandboxSpec("this node does not allow bridge networking")
        # The node's own network namespace reaches its gRPC port: test-only, evaluation only.
        if spec.network == "host" and not (
            spec.for_evaluation and self.settings.evaluation_host_network_test_only
        ):
            raise InvalidSandboxSpec("host networking is for the tests' evaluation sandboxes only")
        res = spec.resources
        if res is not None and (res.cpus < 0 or res.memory_bytes < 0 or res.pids < 0):
            raise InvalidSandboxSpec("resource limits cannot be negative")
        for key in spec.env:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise InvalidSandboxSpec(f"invalid environment variable name {key!r}")

    async def create(self, spec: CreateSpec) -> SandboxRecord:
        self._validate(spec)
        if spec.request_id:
            existing = self._by_request.get(spec.request_id)
            if existing is not None and existing in self._records:
                return self._records[existing]
            inflight = self._creating.get(spec.request_id)
            if inflight is not None:
                return await asyncio.shield(inflight)
        if self.live_count >= self.settings.max_sandboxes:
            raise NodeAtCapacity(
                f"node {self.settings.node_id} hosts {self.live_count} of"
                f" {self.settings.max_sandboxes} sandboxes",
                node_id=self.settings.node_id,
                capacity=self.settings.max_sandboxes,
            )
        # The create runs to completion even if the caller goes away: a half-made container
        # would otherwise exist without a record. A retry with the same request_id finds it.
        self._pending_creates += 1
        self._creating_images[spec.image] += 1
        task = asyncio.get_running_loop().create_task(self._create(spec))
        if spec.request_id:
            self._creating[spec.request_id] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._creating.pop(spec.request_id, None)
            else:
                task.add_done_callback(lambda _: self._creating.pop(spec.request_id, None))

    async def _create(self, spec: CreateSpec) -> SandboxRecord:
        try:
            image_info = await self.backend.inspect_image(spec.from_image or spec.image)
            if image_info is None:
                raise ImageNotPresent(
                    f"image {spec.image!r} is not present on node {self.settings.node_id};"
                    " swerl never pulls implicitly (use EnsureImages)",
                    image=spec.image,
                    node_id=self.settings.node_id,
                )
            s = self.settings
            res = spec.resources or Resources(0, 0, 0)
            resources = Resources(
                cpus=res.cpus or s.default_cpus,
                memory_bytes=res.memory_bytes or s.default_memory_bytes,
                pids=res.pids or s.default_pids,
            )
            sandbox_id = "sbx-" + uuid.uuid4().hex[:20]
            now = time.time()
            expire = now + (spec.ttl_s or s.default_ttl_s)
            labels = {
                LABEL_PREFIX + "managed": "1",
                LABEL_PREFIX + "node": s.node_id,
                LABEL_PREFIX + "sandbox_id": sandbox_id,
                LABEL_PREFIX + "image": spec.image,
                LABEL_PREFIX + "workdir": spec.workdir,
                LABEL_PREFIX + "create_time": f"{now:.3f}",
                LABEL_PREFIX + "expire_time": f"{expire:.3f}",
                LABEL_PREFIX + "lease_id": spec.lease_id,
                LABEL_PREFIX + "owner": spec.owner,
                LABEL_PREFIX + "instance_id": spec.instance_id,
                LABEL_PREFIX + "request_id": spec.request_id,
                LABEL_PREFIX + "network": spec.network,
                LABEL_PREFIX + "cpus": f"{resources.cpus:g}",
                LABEL_PREFIX + "memory_bytes": str(resources.memory_bytes),
                LABEL_PREFIX + "pids": str(resources.pids),
            }
            if spec.checkpoint_id:
                labels[LABEL_PREFIX + "checkpoint_id"] = spec.checkpoint_id
            labels.update({ENV_LABEL + k: v for k, v in spec.env.items()})
            labels.update({USER_LABEL + k: v for k, v in spec.labels.items()})
            container_id = await self.backend.create_and_start(
                ContainerSpec(
                    name="swerl-" + sandbox_id,
                    image=spec.from_image or spec.image,
                    workdir=spec.workdir,
                    env=dict(spec.env),
                    labels=labels,
                    cpus=resources.cpus,
                    memory_bytes=resources.memory_bytes,
                    pids=resources.pids,
                    network=spec.network,
                    cap_add=tuple(s.cap_add),
                    binds=((str(ensure_io_dir(self.io_dir(sandbox_id))), CONTAINER_IO_DIR),),
                    ro_binds=((str(self._bundle_root()), BUNDLE_MOUNT),),
                )
            )
            record = self._record_from_labels(container_id, labels, expire)
            self.store.put(StoredSandbox(sandbox_id, container_id, spec.request_id, expire))
            self._records[sandbox_id] = record
            if spec.request_id:
                self._by_request[spec.request_id] = sandbox_id
            # The login shell (profile, conda activation) starts now rather than on the first
            # command, off the agent's critical path.
            record.shell.warm()
            if not spec.from_image:  # fork images are the fork manager's, not the cache's
                self.images.mark_used(str(image_info["Id"]))
            log.info("sandbox.created", sandbox_id=sandbox_id, image=spec.image)
            return record
        finally:
            self._pending_creates -= 1
            self._creating_images[spec.image] -= 1
            if self._creating_images[spec.image] <= 0:
                del self._creating_images[spec.image]

    async def renew(self, sandbox_id: str, ttl_s: float) -> SandboxRecord:
        record = self.get(sandbox_id)
        if ttl_s < 0 or ttl_s > self.settings.max_ttl_s:
            raise InvalidSandboxSpec(f"ttl must be between 0 and {self.settings.max_ttl_s:g} s")
        record.expire_time = time.time() + (ttl_s or self.settings.default_ttl_s)
        self.store.set_expiry(sandbox_id, record.expire_time)
        return record

    async def bind(
        self, sandbox_id: str, lease_id: str, owner: str, instance_id: str, ttl_s: float
    ) -> SandboxRecord:
        """Hands a sandbox to a lease (durably) and renews it."""
        record = await self.renew(sandbox_id, ttl_s)
        self.store.bind(sandbox_id, lease_id, owner, instance_id)
        record.lease_id, record.owner, record.instance_id = lease_id, owner, instance_id
        return record

    async def destroy(self, sandbox_id: str) -> bool:
        """Removes the sandbox; False if it did not exist. Frees its slot only once Docker
        confirmed the removal (a failed removal keeps counting against capacity)."""
        record = self._records.get(sandbox_id)
        if record is None:
            return False
        if record.destroying is not None:
            return await asyncio.shield(record.destroying)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        record.destroying = future
        try:
            await record.shell.close()
            await self.backend.remove(record.container_id)
        except BaseException as exc:
            record.destroying = None
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else must log it
            raise
        shutil.rmtree(self.io_dir(sandbox_id), ignore_errors=True)
        self._records.pop(sandbox_id, None)
        if record.request_id:
            self._by_request.pop(record.request_id, None)
        self.store.delete(sandbox_id)
        future.set_result(True)
        log.info("sandbox.destroyed", sandbox_id=sandbox_id)
        for hook in self.after_destroy:
            hook(record)
        return True

    # -- commands -------------------------------------------------------------------------
    def start_command(self, sandbox_id: str, spec: CommandSpec) -> CommandRun:
        check_command(spec, sandbox_id)
        record = self.get(sandbox_id)
        if record.shell.lost is not None:
            raise record.shell.lost
        return record.shell.start(with_node_defaults(spec, self.settings, record.workdir))

    async def diff(
        self, sandbox_id: str, base_ref: str, include_untracked: bool, path: str
    ) -> DiffResult:
        record = self.get(sandbox_id)
        return await git_diff(
            record.shell,
            sandbox_id,
            path or record.workdir or ".",
            base_ref,
            include_untracked,
            self.settings.max_diff_bytes,
        )

    # -- images ---------------------------------------------------------------------------
    async def list_images(self) -> list[CachedImage]:
        return await self.images.listing()

    def ensure_images(
        self, images: list[str], mirror_prefix: str, concurrency: int
    ) -> AsyncIterator[ImageEvent]:
        return ensure_images(self.images, images, mirror_prefix, concurrency)
