"""Pre-pulls a dataset's images onto exec nodes through the nodes' EnsureImages stream.

The pool pulls a missing image on demand (onto one of the image's home nodes), so pre-pulling is
optional: it takes the first pulls out of the first batch's way. `--replicas k` pulls each image
only onto its k home nodes, chosen as the pool chooses them (swerl.pool.client.image_homes:
rendezvous hashing over the nodes the pool's ListNodes reports HEALTHY), so pre-pull and
placement agree and each node holds about k/N of the dataset; without it every node gets every
image (a pool run with --no-pull needs that, and it only fits a dataset smaller than a node's
disk). Each node gets
its list in batches over `EnsureImages`, pulls with its own concurrency (optionally from a
registry mirror, re-tagged to the canonical name), and streams one result per image. Failures
that a later attempt can cure (registry unreachable, a pull cut short) and a node that drops the
stream are retried with swerl's one retry policy; images that stay missing end up in the report
with the node's reason. `status` compares the dataset with each node's ListImages.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import tenacity

from swerl.chassis.client import error_info, make_channel
from swerl.chassis.retry import async_retrying
from swerl.exec.client import ENSURE_IMAGES_TIMEOUT_S, SandboxClient
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.pool.model import NodeState

# Per-image failure reasons (ImagePullResult.reason) worth another attempt.
TRANSIENT_REASONS = frozenset({"REGISTRY_UNREACHABLE", "PULL_FAILED"})
_STATUS = {
    pb.IMAGE_PULL_STATUS_PRESENT: "present",
    pb.IMAGE_PULL_STATUS_PULLED: "pulled",
    pb.IMAGE_PULL_STATUS_FAILED: "failed",
}


class ImageListError(ValueError):
    """An image list or dataset file could not be read."""


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str


@dataclass
class NodeProgress:
    """What one node did with the image list; updated as results stream in."""

    address: str
    total: int
    present: set[str] = field(default_factory=set)
    pulled: set[str] = field(default_factory=set)
    failed: dict[str, Failure] = field(default_factory=dict)
    error: str = ""  # the node itself failed (unreachable, refused the token, ...)
    attempts: int = 0

    @property
    def done(self) -> int:
        return len(self.present) + len(self.pulled) + len(self.failed)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.error and self.done == self.total

    def line(self) -> str:
        text = (
            f"{self.address}: {self.done}/{self.total} present {len(self.present)} "
            f"pulled {len(self.pulled)} failed {len(self.failed)}"
        )
        return text + (f" ERROR {self.error}" if self.error else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "total": self.total,
            "present": len(self.present),
            "pulled": len(self.pulled),
            "failed": {image: vars(f) for image, f in sorted(self.failed.items())},
            "error": self.error,
            "attempts": self.attempts,
        }


@dataclass
class PullReport:
    nodes: list[NodeProgress]

    @property
    def ok(self) -> bool:
        return all(node.ok for node in self.nodes)

    def missing(self) -> dict[str, dict[str, str]]:
        """image -> {node address: reason} for every image some node does not have."""
        out: dict[str, dict[str, str]] = {}
        for node in self.nodes:
            for image, failure in node.failed.items():
                out.setdefault(image, {})[node.address] = failure.reason
        return dict(sorted(out.items()))

    def render(self) -> str:
        lines = [node.line() for node in self.nodes]
        missing = self.missing()
        if missing:
            lines.append(f"missing images: {len(missing)}")
            for image, where in missing.items():
                lines.append(
                    f"  {image}: " + ", ".join(f"{a} {r}" for a, r in sorted(where.items()))
                )
        else:
            lines.append("every image is present on every node" if self.ok else "")
        return "\n".join(line for line in lines if line)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "nodes": [node.to_json() for node in self.nodes],
            "missing": self.missing(),
        }


class _TransientFailures(Exception):
    """Some images failed for reasons a later attempt can cure; raised to trigger a retry."""


def read_image_list(path: Path) -> list[str]:
    """Images from a text file (one per line, `#` comments) or a JSONL dataset (prepared or raw
    rows; image names follow `swerl data prepare`'s rules), deduplicated in order."""
    from swerl.data.naming import image_name

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ImageListError(f"{path}: {exc.strerror or exc}") from None
    images: dict[str, None] = {}
    if path.suffix.lower() in (".jsonl", ".json"):
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ImageListError(f"{path}:{number}: not JSON: {exc}") from None
            metadata = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
            instance = metadata.get("instance") if isinstance(metadata, dict) else None
            instance = instance if isinstance(instance, dict) else row
            if "instance_id" not in instance and not instance.get("image_name"):
                raise ImageListError(f"{path}:{number}: neither instance_id nor image_name")
            source = str(metadata.get("data_source") or path.stem)
            images[image_name(instance, convention="auto", data_source=source)] = None
    else:
        for line in text.splitlines():
            name = line.split("#", 1)[0].strip()
            if name:
                images[name] = None
    return list(images)


def canonical_image(name: str) -> str:
    """How Docker lists a reference in RepoTags: no docker.io/ or library/, a tag always (the
    name the pool hashes an image under, too)."""
    from swerl.pool.client import image_key

    return image_key(name)


class ImagePuller:
    """Runs EnsureImages on many nodes at once, with retries; see the module docstring."""

    def __init__(
        self,
        *,
        token: str | None = None,
        mirror_prefix: str = "",
        concurrency: int = 4,
        batch_size: int = 64,
        retries: int = 3,
        initial_wait_s: float = 1.0,
        max_wait_s: float = 30.0,
        call_timeout_s: float = ENSURE_IMAGES_TIMEOUT_S,
        on_progress: Callable[[NodeProgress, str], None] | None = None,
    ) -> None:
        self.token = token
        self.mirror_prefix = mirror_prefix
        self.concurrency = concurrency
        self.batch_size = max(1, batch_size)
        self.retries = retries
        self.initial_wait_s = initial_wait_s
        self.max_wait_s = max_wait_s
        self.call_timeout_s = call_timeout_s
        self.on_progress = on_progress or (lambda node, image: None)

    async def pull(self, addresses: Sequence[str], images: Sequence[str]) -> PullReport:
        images = list(dict.fromkeys(images))
        return await self.pull_plan({address: images for address in addresses})

    async def pull_plan(self, plan: Mapping[str, Sequence[str]]) -> PullReport:
        """Pulls each node's own list (address -> images), e.g. `home_plan`'s."""
        lists = {address: list(dict.fromkeys(images)) for address, images in plan.items()}
        nodes = [NodeProgress(address, len(images)) for address, images in lists.items()]
        await asyncio.gather(*(self._pull_node(node, lists[node.address]) for node in nodes))
        return PullReport(nodes)

    def _policy(self) -> tenacity.AsyncRetrying:
        # swerl's one policy (UNAVAILABLE and our reasons, exponential jitter, attempts and time
        # bounded, reraise), also retrying images whose failure a later attempt can cure.
        policy = async_retrying(
            max_attempts=self.retries + 1,
            max_delay_s=max(60.0, self.max_wait_s * (self.retries + 1)),
            initial_wait_s=self.initial_wait_s,
            max_wait_s=self.max_wait_s,
        )
        return policy.copy(
            retry=policy.retry | tenacity.retry_if_exception_type(_TransientFailures)
        )

    async def _pull_node(self, node: NodeProgress, images: list[str]) -> None:
        channel = make_channel(node.address, token=self.token)
        client = SandboxClient(channel)
        try:
            for start in range(0, len(images), self.batch_size):
                await self._pull_batch(client, node, images[start : start + self.batch_size])
                if node.error:
                    return
        finally:
            await channel.close()

    async def _pull_batch(
        self, client: SandboxClient, node: NodeProgress, batch: list[str]
    ) -> None:
        pending = list(batch)
        retried: dict[str, Failure] = {}
        try:
            async for attempt in self._policy():
                with attempt:
                    node.attempts += 1
                    await self._ensure(client, node, pending)
                    pending = [
                        image
                        for image in pending
                        if image in node.failed and node.failed[image].reason in TRANSIENT_REASONS
                    ]
                    if pending:
                        # The next attempt reports these anew; keep the failure in case it
                        # never comes.
                        retried = {image: node.failed.pop(image) for image in pending}
                        raise _TransientFailures(pending)
        except _TransientFailures:
            node.failed.update(retried)  # out of attempts: the last failures stand
        except grpc.RpcError as exc:
            reason = error_info(exc)[0] or exc.code().name
            node.error = f"{reason}: {exc.details()}"
            for image in batch:
                if image not in node.present and image not in node.pulled:
                    node.failed.setdefault(image, Failure("NODE_FAILED", node.error))
            self.on_progress(node, "")

    async def _ensure(self, client: SandboxClient, node: NodeProgress, images: list[str]) -> None:
        responses = client.ensure_images(
            images,
            mirror_prefix=self.mirror_prefix,
            concurrency=self.concurrency,
            timeout_s=self.call_timeout_s,
        )
        async for response in responses:
            if response.WhichOneof("kind") != "result":
                continue
            result = response.result
            status = _STATUS.get(result.status, "failed")
            if status == "present":
                node.present.add(result.image)
            elif status == "pulled":
                node.pulled.add(result.image)
            else:
                node.failed[result.image] = Failure(result.reason or "PULL_FAILED", result.message)
            self.on_progress(node, result.image)


@dataclass
class NodeCoverage:
    address: str
    node_id: str = ""
    present: int = 0
    missing: list[str] = field(default_factory=list)
    error: str = ""

    def line(self, total: int) -> str:
        if self.error:
            return f"{self.address}: ERROR {self.error}"
        share = 100.0 * self.present / total if total else 100.0
        name = f" ({self.node_id})" if self.node_id and self.node_id != self.address else ""
        return (
            f"{self.address}{name}: {self.present}/{total} images present ({share:.1f}%), "
            f"{len(self.missing)} missing"
        )


async def coverage(
    addresses: Iterable[str], images: Sequence[str], *, token: str | None = None
) -> list[NodeCoverage]:
    """Per node: how many of `images` it has (ListImages), and which are missing."""

    async def one(address: str) -> NodeCoverage:
        channel = make_channel(address, token=token)
        client = SandboxClient(channel)
        result = NodeCoverage(address)
        try:
            async for attempt in async_retrying(max_attempts=3):
                with attempt:
                    info = await client.node_info()
                    listed = await client.list_images()
        except grpc.RpcError as exc:
            reason = error_info(exc)[0] or exc.code().name
            result.error = f"{reason}: {exc.details()}"
            return result
        finally:
            await channel.close()
        result.node_id = info.node_id
        tags = {canonical_image(tag) for image in listed for tag in image.repo_tags}
        for image in images:
            if canonical_image(image) in tags:
                result.present += 1
            else:
                result.missing.append(image)
        return result

    return list(await asyncio.gather(*(one(address) for address in addresses)))


@dataclass(frozen=True)
class PoolNode:
    """A node as the pool lists it (ListNodes): its id, address and state in the pool's view."""

    node_id: str
    address: str
    state: NodeState


async def pool_nodes(pool: str, token: str | None) -> list[PoolNode]:
    """Every node the pool knows, with the state the pool gives it (ListNodes)."""
    from swerl.pool.client import PoolClient, node_state

    client = PoolClient(pool, token=token)
    try:
        async for attempt in async_retrying(max_attempts=3):
            with attempt:
                listed = await client.list_nodes()
    finally:
        await client.close()
    # A state this client does not know (a newer pool) is not HEALTHY: no image is homed there.
    return [PoolNode(node.node_id, node.address, node_state(node.state)) for node in listed]


async def node_addresses(nodes: Sequence[str], pool: str | None, token: str | None) -> list[str]:
    """The explicit node addresses, plus every node the pool knows that is not drained."""
    addresses = dict.fromkeys(nodes)
    if pool:
        for node in await pool_nodes(pool, token):
            if node.state is not NodeState.DRAINED:
                addresses[node.address] = None
    return list(addresses)


def home_plan(
    images: Sequence[str], nodes: Sequence[PoolNode], replicas: int
) -> dict[str, list[str]]:
    """address -> the images whose home set includes that node, for every node images are homed
    on. The nodes hashed over and the hashing are the pool's own (swerl.pool.client's
    `home_nodes` over the pool's node states, then `image_homes`), so an image is pre-pulled
    exactly where the pool's placement would pull it: nodes the pool does not count as healthy
    (unhealthy, draining, not yet synced) get nothing, as in the pool."""
    from swerl.pool.client import home_nodes, image_homes

    candidates = home_nodes((node.node_id, node.state) for node in nodes)
    address_of = {node.node_id: node.address for node in nodes}
    plan: dict[str, list[str]] = {address_of[node_id]: [] for node_id in candidates}
    for image, home_ids in image_homes(images, candidates, replicas).items():
        for node_id in home_ids:
            plan[address_of[node_id]].append(image)
    return plan
