"""Forks and checkpoints of sandboxes: the filesystem of an idle sandbox, copied into new ones.

A checkpoint is the source container's writable layer committed to a node-local image
("swerl-fork:<checkpoint_id>", never pushed). Docker pauses the container for the commit and the
fork holds the sandbox's shell turn, so the layer is the filesystem between two commands; new
sandboxes are then created from that image like from a task image (processes are not carried:
each copy starts its own shell). ForkSandbox makes a fork point that ends with its last copy;
CheckpointSandbox makes a named one that lives until its TTL, independently of the source and its
lease, so copies can be made later (CreateSandbox{from_checkpoint}).

Everything a restarted node needs is on the image's labels (`swerl.checkpoint_id`, `swerl.node`,
expiry, request id), like on containers; only a DeleteCheckpoint, which changes the expiry later,
is also kept in a small SQLite table. An image is removed once its checkpoint has ended and no
sandbox uses it, after a destroy, on the reaper's round and when a restarted node reconciles.

The node's image budget (issue 14) is where fork images are to be counted: `list_fork_images`
gives their ids and sizes, and the budget must never evict one `in_use` reports as used.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import structlog

from swerl.chassis.bounded import within
from swerl.chassis.sqlite import SqliteStore
from swerl.exec.errors import CheckpointNotFound, InvalidSandboxSpec, NodeAtCapacity, SandboxBusy
from swerl.exec.images import FORK_IMAGE_LABEL
from swerl.exec.labels import ENV_LABEL, LABEL_PREFIX, USER_LABEL
from swerl.exec.sandboxes import CreateSpec, Resources, SandboxManager, SandboxRecord

log = structlog.get_logger(__name__)

FORK_REPOSITORY = "swerl-fork"
CHECKPOINT_LABEL = FORK_IMAGE_LABEL  # on fork images and the sandboxes made from them
# A checkpoint's own caller labels, kept apart from the source's `swerl.user.*` ones (which the
# image also carries and its copies inherit).
CHECKPOINT_USER_LABEL = LABEL_PREFIX + "checkpoint.user."

SCHEMA = """
CREATE TABLE IF NOT EXISTS ended_checkpoints (
    checkpoint_id TEXT PRIMARY KEY,
    end_time      REAL NOT NULL
);
"""


class CheckpointStore(SqliteStore):
    """Checkpoints ended before their labelled expiry (DeleteCheckpoint): labels are fixed."""

    def __init__(self, path: str) -> None:
        super().__init__(path, SCHEMA, synchronous="NORMAL")

    def end(self, checkpoint_id: str, end_time: float) -> None:
        self.execute(
            "INSERT OR REPLACE INTO ended_checkpoints VALUES (?, ?)", (checkpoint_id, end_time)
        )

    def forget(self, checkpoint_id: str) -> None:
        self.execute("DELETE FROM ended_checkpoints WHERE checkpoint_id = ?", (checkpoint_id,))

    def ended(self) -> dict[str, float]:
        return {r[0]: float(r[1]) for r in self.rows("SELECT * FROM ended_checkpoints")}


@dataclass
class Checkpoint:
    checkpoint_id: str
    name: str
    source_sandbox_id: str
    image: str  # the task image of the source
    image_id: str  # the fork image's id
    workdir: str
    env: dict[str, str]
    source_labels: dict[str, str]  # the source's caller labels, inherited by copies
    resources: Resources
    network: str
    create_time: float
    # No new copies after this time; a ForkSandbox fork point has create_time (its copies are
    # made under a pin, it ends with the last of them).
    expire_time: float
    request_id: str
    labels: dict[str, str] = field(default_factory=dict)
    size_bytes: int = 0
    # Operations between taking the checkpoint and creating from it; GC leaves it alone then.
    pins: int = 0

    @property
    def fork_image(self) -> str:
        return f"{FORK_REPOSITORY}:{self.checkpoint_id}"


@dataclass(frozen=True)
class ForkResult:
    checkpoint: Checkpoint
    sandboxes: list[SandboxRecord]


class ForkManager:
    """Takes checkpoints, makes sandboxes from them and removes their images when unused."""

    def __init__(self, manager: SandboxManager, store: CheckpointStore) -> None:
        self.manager = manager
        self.backend = manager.backend
        self.settings = manager.settings
        self.store = store
        self._checkpoints: dict[str, Checkpoint] = {}
        self._by_request: dict[str, str] = {}
        self._taking: dict[str, asyncio.Future[Checkpoint]] = {}
        self._forking: dict[str, asyncio.Future[ForkResult]] = {}
        self._gc_wanted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        manager.after_destroy.append(lambda _: self._gc_wanted.set())

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.reconcile()
        self._task = asyncio.get_running_loop().create_task(self._gc_loop(), name="exec.fork-gc")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # A last round: images whose last copy was destroyed just before the stop go now
        # rather than at the next start.
        with contextlib.suppress(Exception):
            await self.collect()
        self._checkpoints.clear()
        self._by_request.clear()

    async def reconcile(self) -> None:
        """Adopts this node's fork images that a live checkpoint or sandbox needs; removes the
        rest (a fork interrupted by a crash, an ended checkpoint whose copies were reaped)."""
        ended = self.store.ended()
        rows = await self.backend.list_labelled_images(
            {LABEL_PREFIX + "node": self.settings.node_id, CHECKPOINT_LABEL: ""}
        )
        now = time.time()
        adopted = removed = 0
        for row in rows:
            labels = row.get("Labels") or {}
            checkpoint = self._from_labels(str(row["Id"]), labels)
            if checkpoint.checkpoint_id in ended:
                checkpoint.expire_time = min(
                    checkpoint.expire_time, ended[checkpoint.checkpoint_id]
                )
            if checkpoint.expire_time <= now and not self.in_use(checkpoint.checkpoint_id):
                if await self.backend.remove_unused_image(checkpoint.image_id):
                    self.store.forget(checkpoint.checkpoint_id)
                    removed += 1
                    continue
            checkpoint.size_bytes = int(row.get("Size", 0) or 0)
            self._adopt(checkpoint)
            adopted += 1
        for checkpoint_id in ended.keys() - self._checkpoints.keys():
            self.store.forget(checkpoint_id)
        log.info("exec.forks_reconciled", adopted=adopted, removed=removed)

    def _from_labels(self, image_id: str, labels: Mapping[str, str]) -> Checkpoint:
        def label(key: str, default: str = "") -> str:
            return labels.get(LABEL_PREFIX + key, default)

        return Checkpoint(
            checkpoint_id=label("checkpoint_id"),
            name=label("checkpoint.name"),
            source_sandbox_id=label("sandbox_id"),
            image=label("image"),
            image_id=image_id,
            workdir=label("workdir"),
            env={k[len(ENV_LABEL) :]: v for k, v in labels.items() if k.startswith(ENV_LABEL)},
            source_labels={
                k[len(USER_LABEL) :]: v for k, v in labels.items() if k.startswith(USER_LABEL)
            },
            resources=Resources(
                cpus=float(label("cpus", "0") or 0),
                memory_bytes=int(label("memory_bytes", "0") or 0),
                pids=int(label("pids", "0") or 0),
            ),
            network=label("network", "none"),
            create_time=float(label("checkpoint.create_time", "0") or 0),
            expire_time=float(label("checkpoint.expire_time", "0") or 0),
            request_id=label("checkpoint.request_id"),
            labels={
                k[len(CHECKPOINT_USER_LABEL) :]: v
                for k, v in labels.items()
                if k.startswith(CHECKPOINT_USER_LABEL)
            },
        )

    def _adopt(self, checkpoint: Checkpoint) -> None:
        self._checkpoints[checkpoint.checkpoint_id] = checkpoint
        if checkpoint.request_id:
            self._by_request[checkpoint.request_id] = checkpoint.checkpoint_id

    # -- queries --------------------------------------------------------------------------
    def in_use(self, checkpoint_id: str) -> int:
        """Live sandboxes created from the checkpoint (the image budget must keep its image)."""
        return sum(1 for r in self.manager.list_sandboxes({}) if r.checkpoint_id == checkpoint_id)

    def list_checkpoints(self) -> list[Checkpoint]:
        return list(self._checkpoints.values())

    def list_fork_images(self) -> list[tuple[str, int]]:
        """(image id, size in bytes) of every fork image this node holds."""
        return [(c.image_id, c.size_bytes) for c in self._checkpoints.values()]

    def live(self, checkpoint_id: str) -> Checkpoint:
        """A checkpoint that new sandboxes can still be made from."""
        checkpoint = self._checkpoints.get(checkpoint_id)
        if checkpoint is None or checkpoint.expire_time <= time.time():
            raise CheckpointNotFound(
                f"no live checkpoint {checkpoint_id!r} on node {self.settings.node_id}",
                checkpoint_id=checkpoint_id,
            )
        return checkpoint

    # -- taking a checkpoint ---------------------------------------------------------------
    def _ttl(self, ttl_s: float) -> float:
        if ttl_s < 0 or ttl_s > self.settings.max_ttl_s:
            raise InvalidSandboxSpec(
                f"ttl must be between 0 and {self.settings.max_ttl_s:g} s, got {ttl_s:g}"
            )
        return ttl_s or self.settings.default_ttl_s

    async def checkpoint(
        self,
        sandbox_id: str,
        *,
        request_id: str = "",
        name: str = "",
        ttl_s: float = 0.0,
        labels: Mapping[str, str] | None = None,
    ) -> Checkpoint:
        """A named checkpoint of an idle sandbox, alive for ttl_s whatever becomes of it."""
        ttl = self._ttl(ttl_s)
        checkpoint = await self._take(sandbox_id, request_id, name, ttl, dict(labels or {}))
        checkpoint.pins -= 1
        return checkpoint

    async def _take(
        self, sandbox_id: str, request_id: str, name: str, ttl_s: float, labels: dict[str, str]
    ) -> Checkpoint:
        # Returns the checkpoint pinned for the caller (GC leaves it alone until it unpins), so
        # a ForkSandbox's fork point, which ends at once, lives until its copies exist.
        if request_id:
            existing = self._by_request.get(request_id)
            if existing is not None and existing in self._checkpoints:
                self._checkpoints[existing].pins += 1
                return self._checkpoints[existing]
            inflight = self._taking.get(request_id)
            if inflight is not None:
                checkpoint = await asyncio.shield(inflight)
                checkpoint.pins += 1
                return checkpoint
        record = self.manager.get(sandbox_id)
        if record.shell.busy():
            raise SandboxBusy(
                f"sandbox {sandbox_id!r} has a command running or waiting; fork it between"
                " commands",
                sandbox_id=sandbox_id,
            )
        # Like a create, the commit runs to completion even if the caller goes away, so a
        # retry with the same request_id finds the image rather than making a second one.
        task = asyncio.get_running_loop().create_task(
            self._commit(record, request_id, name, ttl_s, labels)
        )
        if request_id:
            self._taking[request_id] = task
            task.add_done_callback(lambda _: self._taking.pop(request_id, None))
        return await asyncio.shield(task)

    async def _commit(
        self,
        record: SandboxRecord,
        request_id: str,
        name: str,
        ttl_s: float,
        labels: dict[str, str],
    ) -> Checkpoint:
        checkpoint_id = "ckp-" + uuid.uuid4().hex[:20]
        now = time.time()
        checkpoint = Checkpoint(
            checkpoint_id=checkpoint_id,
            name=name,
            source_sandbox_id=record.sandbox_id,
            image=record.image,
            image_id="",
            workdir=record.workdir,
            env=dict(record.env),
            source_labels=dict(record.labels),
            resources=record.resources,
            network=record.network,
            create_time=now,
            expire_time=now + ttl_s,
            request_id=request_id,
            labels=labels,
            pins=1,
        )
        # The image inherits the container's labels (sandbox, image, env, limits, caller
        # labels: what its copies need); these mark it as this node's fork image.
        image_labels = {
            LABEL_PREFIX + "node": self.settings.node_id,
            CHECKPOINT_LABEL: checkpoint_id,
            LABEL_PREFIX + "checkpoint.name": name,
            LABEL_PREFIX + "checkpoint.create_time": f"{now:.3f}",
            LABEL_PREFIX + "checkpoint.expire_time": f"{checkpoint.expire_time:.3f}",
            LABEL_PREFIX + "checkpoint.request_id": request_id,
        }
        image_labels.update({CHECKPOINT_USER_LABEL + k: v for k, v in labels.items()})
        shell = record.shell
        # Holding the shell's turn keeps commands out until the commit is done (Docker also
        # pauses the container): the layer is the filesystem between two commands.
        await shell.take_turn(checkpoint)
        try:
            started = time.monotonic()
            checkpoint.image_id = await self.backend.commit(
                record.container_id, FORK_REPOSITORY, checkpoint_id, image_labels
            )
        finally:
            shell.end_turn(checkpoint)
        checkpoint.size_bytes = await self.backend.top_layer_size(checkpoint.image_id)
        self._adopt(checkpoint)
        log.info(
            "sandbox.checkpointed",
            sandbox_id=record.sandbox_id,
            checkpoint_id=checkpoint_id,
            size_bytes=checkpoint.size_bytes,
            commit_ms=round((time.monotonic() - started) * 1000, 1),
        )
        return checkpoint

    # -- making sandboxes from a checkpoint --------------------------------------------------
    def spec_from(self, checkpoint: Checkpoint, spec: CreateSpec) -> CreateSpec:
        """`spec` (a CreateSandbox request) completed from the checkpoint it names."""
        if spec.image and spec.image != checkpoint.image:
            raise InvalidSandboxSpec(
                f"checkpoint {checkpoint.checkpoint_id} holds {checkpoint.image!r}, not"
                f" {spec.image!r}; leave image empty",
                checkpoint_id=checkpoint.checkpoint_id,
            )
        return replace(
            spec,
            image=checkpoint.image,
            workdir=checkpoint.workdir,
            env={**checkpoint.env, **spec.env},
            labels={**checkpoint.source_labels, **spec.labels},
            resources=checkpoint.resources,
            network=checkpoint.network,
            checkpoint_id=checkpoint.checkpoint_id,
            from_image=checkpoint.image_id,
        )

    async def create_from(self, checkpoint_id: str, spec: CreateSpec) -> SandboxRecord:
        """CreateSandbox{from_checkpoint}: a sandbox whose filesystem is the checkpoint's."""
        if spec.request_id:
            existing = self.manager.by_request_id(spec.request_id)
            if existing is not None:
                return existing
        checkpoint = self.live(checkpoint_id)
        checkpoint.pins += 1
        try:
            return await self.manager.create(self.spec_from(checkpoint, spec))
        finally:
            checkpoint.pins -= 1
            self._gc_wanted.set()

    async def fork(
        self,
        sandbox_id: str,
        count: int,
        *,
        request_id: str = "",
        ttl_s: float = 0.0,
        labels: Mapping[str, str] | None = None,
        lease_ids: list[str] | None = None,
        owner: str = "",
    ) -> ForkResult:
        """`count` new sandboxes with the filesystem of idle `sandbox_id`, all or none."""
        lease_ids = list(lease_ids or [])
        if not 1 <= count <= self.settings.max_sandboxes:
            raise InvalidSandboxSpec(
                f"count must be between 1 and {self.settings.max_sandboxes}, got {count}"
            )
        if lease_ids and len(lease_ids) != count:
            raise InvalidSandboxSpec(f"{len(lease_ids)} lease_ids for {count} copies")
        self._ttl(ttl_s)
        if request_id:
            inflight = self._forking.get(request_id)
            if inflight is not None:
                return await asyncio.shield(inflight)
            done = self._fork_done(request_id, count)
            if done is not None:
                return done
        source = self.manager.get(sandbox_id)
        free = self.settings.max_sandboxes - self.manager.live_count
        if count > free:
            raise NodeAtCapacity(
                f"node {self.settings.node_id} has room for {free} more sandboxes, not {count}",
                node_id=self.settings.node_id,
                capacity=self.settings.max_sandboxes,
            )
        task = asyncio.get_running_loop().create_task(
            self._fork(source, count, request_id, ttl_s, dict(labels or {}), lease_ids, owner)
        )
        if request_id:
            self._forking[request_id] = task
            task.add_done_callback(lambda _: self._forking.pop(request_id, None))
        return await asyncio.shield(task)

    def _fork_done(self, request_id: str, count: int) -> ForkResult | None:
        """The result of an earlier ForkSandbox with this request_id, if all its copies live."""
        checkpoint_id = self._by_request.get(request_id + "/fork")
        checkpoint = self._checkpoints.get(checkpoint_id or "")
        if checkpoint is None:
            return None
        copies = [self.manager.by_request_id(f"{request_id}/fork/{i}") for i in range(count)]
        if any(copy is None for copy in copies):
            return None
        return ForkResult(checkpoint, [c for c in copies if c is not None])

    async def _fork(
        self,
        source: SandboxRecord,
        count: int,
        request_id: str,
        ttl_s: float,
        labels: dict[str, str],
        lease_ids: list[str],
        owner: str,
    ) -> ForkResult:
        # The fork point ends at once (expire = now): it only lives on in its copies, and its
        # image goes with the last of them.
        checkpoint = await self._take(
            source.sandbox_id, request_id + "/fork" if request_id else "", "", 0.0, {}
        )
        made: list[SandboxRecord] = []
        try:
            specs = [
                self.spec_from(
                    checkpoint,
                    CreateSpec(
                        image="",
                        request_id=f"{request_id}/fork/{i}" if request_id else "",
                        labels=labels,
                        ttl_s=ttl_s,
                        lease_id=lease_ids[i] if lease_ids else "",
                        owner=owner or source.owner,
                        instance_id=source.instance_id,
                    ),
                )
                for i in range(count)
            ]
            results = await asyncio.gather(
                *(self.manager.create(spec) for spec in specs), return_exceptions=True
            )
            made = [r for r in results if isinstance(r, SandboxRecord)]
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            log.info(
                "sandbox.forked",
                sandbox_id=source.sandbox_id,
                checkpoint_id=checkpoint.checkpoint_id,
                count=count,
            )
            return ForkResult(checkpoint, made)
        except BaseException:
            # All or none: a fork that could not make every copy leaves none behind.
            for record in made:
                with contextlib.suppress(Exception):
                    await self.manager.destroy(record.sandbox_id)
            raise
        finally:
            checkpoint.pins -= 1
            self._gc_wanted.set()

    # -- ending checkpoints ------------------------------------------------------------------
    async def delete(self, checkpoint_id: str) -> bool:
        checkpoint = self._checkpoints.get(checkpoint_id)
        if checkpoint is None or checkpoint.expire_time <= time.time():
            return False
        checkpoint.expire_time = time.time()
        self.store.end(checkpoint_id, checkpoint.expire_time)
        await self.collect()
        return True

    async def collect(self) -> None:
        """Removes the images of ended checkpoints that no sandbox uses."""
        now = time.time()
        for checkpoint in list(self._checkpoints.values()):
            if (
                checkpoint.expire_time > now
                or checkpoint.pins
                or self.in_use(checkpoint.checkpoint_id)
            ):
                continue
            try:
                gone = await self.backend.remove_unused_image(checkpoint.image_id)
            except Exception as exc:  # retried next round
                log.warning(
                    "checkpoint.remove_failed",
                    checkpoint_id=checkpoint.checkpoint_id,
                    error=str(exc),
                )
                continue
            if gone:
                self._checkpoints.pop(checkpoint.checkpoint_id, None)
                if checkpoint.request_id:
                    self._by_request.pop(checkpoint.request_id, None)
                self.store.forget(checkpoint.checkpoint_id)
                log.info("checkpoint.removed", checkpoint_id=checkpoint.checkpoint_id)

    async def _gc_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._gc_wanted.wait(), self.settings.reap_interval_s)
            self._gc_wanted.clear()
            with contextlib.suppress(Exception):
                await self.collect()
