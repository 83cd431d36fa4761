"""How the pool talks to one exec node: the `NodeConnection` Protocol and its gRPC implementation.

The pool's domain (swerl.pool.leases) only sees this Protocol, so the benchmark can put 1,000
simulated in-process nodes behind it. Failures come back as the domain exceptions of
swerl.pool.errors (NodeUnreachable, NodeImageMissing, NodeFull, NodeSandboxGone, NodeRejected).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast

import grpc
from grpc_health.v1 import health_pb2

from swerl.chassis.capability import LEASE_TOKEN_METADATA_KEY
from swerl.chassis.client import error_info, make_channel
from swerl.chassis.timeconv import duration_pb
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.exec.v1 import sandbox_pb2_grpc
from swerl.pool.errors import (
    NodeFull,
    NodeImageMissing,
    NodeRejected,
    NodeSandboxGone,
    NodeUnreachable,
)


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    capacity: int
    running: int
    version: str
    docker_healthy: bool
    docker_error: str
    # The node's image cache budget and use; 0 when the node does not report them (older
    # nodes), which the pool reads as "unknown, unlimited".
    image_budget_bytes: int = 0
    image_used_bytes: int = 0


@dataclass(frozen=True)
class NodeImages:
    """Every name the node's images answer to (repo tags and ids), and the bytes they take."""

    names: set[str]
    size_bytes: int = 0


@dataclass(frozen=True)
class PullProgress:
    status: str  # Docker's status line ("Downloading", "Extracting", ...)
    current_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class PullOutcome:
    """One image's ImagePullResult: PRESENT, PULLED or FAILED with the node's reason."""

    status: str
    reason: str = ""
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("PRESENT", "PULLED")


@dataclass(frozen=True)
class SandboxFacts:
    sandbox_id: str
    image: str
    lease_id: str
    owner: str
    instance_id: str
    expire_time: float
    running: bool
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CreateRequest:
    request_id: str
    image: str
    ttl_s: float
    lease_id: str = ""
    owner: str = ""
    instance_id: str = ""
    workdir: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: float = 0.0
    memory_bytes: int = 0
    pids: int = 0
    network: int = 0  # swerl.exec.v1.NetworkMode
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ForkRequest:
    """The node's ForkSandbox call for the pool's ForkLease."""

    request_id: str
    sandbox_id: str
    # The source lease's capability token: the node checks it like on any call about the sandbox.
    lease_token: str
    lease_ids: tuple[str, ...]
    ttl_s: float
    owner: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ForkFacts:
    checkpoint_id: str
    sandboxes: tuple[SandboxFacts, ...]


class NodeConnection(Protocol):
    """One exec node as the pool needs it. Every call has its own deadline."""

    async def info(self) -> NodeFacts: ...

    async def images(self) -> NodeImages: ...

    async def pull(self, image: str, on_progress: Callable[[PullProgress], None]) -> PullOutcome:
        """Makes `image` present on the node (EnsureImages of that one image), calling
        `on_progress` as bytes arrive. A pull the node could not do is a FAILED outcome with
        its reason; only a node that cannot be reached raises (NodeUnreachable)."""
        ...

    async def create(self, request: CreateRequest) -> SandboxFacts: ...

    async def bind(
        self, sandbox_id: str, lease_id: str, owner: str, instance_id: str, ttl_s: float
    ) -> SandboxFacts: ...

    async def renew(self, sandbox_id: str, ttl_s: float) -> float:
        """The sandbox's new expiry (unix seconds)."""
        ...

    async def destroy(self, sandbox_id: str) -> bool: ...

    async def fork(self, request: ForkRequest) -> ForkFacts:
        """One new sandbox per lease id, copies of the idle source, in that order."""
        ...

    async def list_sandboxes(self) -> list[SandboxFacts]: ...

    def watch_health(self) -> AsyncIterator[bool]:
        """Yields whether the node is serving, at once and on every change; raises
        NodeUnreachable when the watch breaks."""
        ...

    async def close(self) -> None: ...


def _facts(sandbox: pb.Sandbox) -> SandboxFacts:
    return SandboxFacts(
        sandbox_id=sandbox.sandbox_id,
        image=sandbox.image,
        lease_id=sandbox.lease_id,
        owner=sandbox.owner,
        instance_id=sandbox.instance_id,
        expire_time=sandbox.expire_time.seconds + sandbox.expire_time.nanos / 1e9,
        running=sandbox.state == pb.SANDBOX_STATE_RUNNING,
        labels=dict(sandbox.labels),
    )


def _translate(err: grpc.aio.AioRpcError, address: str) -> Exception:
    code = err.code()
    reason, _ = error_info(err)
    message = f"node {address}: {err.details()}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or (
        code == grpc.StatusCode.CANCELLED
    ):
        return NodeUnreachable(message, address=address)
    if reason == "IMAGE_NOT_PRESENT":
        return NodeImageMissing(message)
    if reason == "NODE_AT_CAPACITY":
        return NodeFull(message)
    if reason == "SANDBOX_NOT_FOUND":
        return NodeSandboxGone(message)
    return NodeRejected(message, code=code.name, reason=reason)


# Node channels reconnect quickly: a restarted node must be seen again within a second or two,
# not after gRPC's default reconnect backoff (up to two minutes).
_NODE_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class GrpcNodeConnection:
    """A NodeConnection over the node's SandboxService and grpc.health.v1."""

    def __init__(self, address: str, *, token: str | None, timeout_s: float = 60.0) -> None:
        self.address = address
        self._channel = make_channel(address, token=token, extra_options=_NODE_CHANNEL_OPTIONS)
        self._stub = sandbox_pb2_grpc.SandboxServiceStub(self._channel)
        # grpc.health.v1's Watch, built as its stub builds it: the typed stubs of
        # grpcio-health-checking declare HealthStub without its methods.
        self._health_watch = self._channel.unary_stream(
            "/grpc.health.v1.Health/Watch",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        self._timeout_s = timeout_s

    async def _call(self, method, request, timeout_s: float | None = None, metadata=None):
        try:
            return await method(request, timeout=timeout_s or self._timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            raise _translate(err, self.address) from None

    async def info(self) -> NodeFacts:
        r = await self._call(self._stub.GetNodeInfo, pb.GetNodeInfoRequest(), 10.0)
        return NodeFacts(
            r.node_id,
            r.capacity,
            r.running,
            r.version,
            r.docker_healthy,
            r.docker_error,
            # Read by name: nodes older than the image cache lack these fields (0: unknown).
            int(getattr(r, "image_budget_bytes", 0) or 0),
            int(getattr(r, "image_used_bytes", 0) or 0),
        )

    async def images(self) -> NodeImages:
        r = await self._call(self._stub.ListImages, pb.ListImagesRequest(), 30.0)
        names: set[str] = set()
        size = 0
        for image in r.images:
            names.add(image.image_id)
            names.update(image.repo_tags)
            size += image.size_bytes
        return NodeImages(names, size)

    async def pull(self, image: str, on_progress: Callable[[PullProgress], None]) -> PullOutcome:
        request = pb.EnsureImagesRequest(request_id=uuid.uuid4().hex, images=[image], concurrency=1)
        outcome = PullOutcome("FAILED", "PULL_FAILED", "the node sent no result")
        # No deadline of its own beyond a generous bound: a large image takes minutes, and
        # the leases waiting on it have their own deadlines.
        call = self._stub.EnsureImages(request, timeout=max(self._timeout_s, 3600.0))
        try:
            async for response in call:
                if response.WhichOneof("kind") == "progress":
                    p = response.progress
                    on_progress(PullProgress(p.status, p.current_bytes, p.total_bytes))
                else:
                    r = response.result
                    status = pb.ImagePullStatus.Name(r.status).removeprefix("IMAGE_PULL_STATUS_")
                    outcome = PullOutcome(status, r.reason, r.message)
        except grpc.aio.AioRpcError as err:
            raise _translate(err, self.address) from None
        return outcome

    async def create(self, request: CreateRequest) -> SandboxFacts:
        r = await self._call(
            self._stub.CreateSandbox,
            pb.CreateSandboxRequest(
                request_id=request.request_id,
                image=request.image,
                workdir=request.workdir,
                env=dict(request.env),
                resources=pb.Resources(
                    cpus=request.cpus, memory_bytes=request.memory_bytes, pids=request.pids
                ),
                # The caller's NetworkMode number, carried unchanged from its SandboxSpec.
                network=cast("pb.NetworkMode", request.network),
                labels=dict(request.labels),
                ttl=duration_pb(request.ttl_s),
                lease_id=request.lease_id,
                owner=request.owner,
                instance_id=request.instance_id,
            ),
        )
        return _facts(r.sandbox)

    async def bind(
        self, sandbox_id: str, lease_id: str, owner: str, instance_id: str, ttl_s: float
    ) -> SandboxFacts:
        r = await self._call(
            self._stub.BindSandbox,
            pb.BindSandboxRequest(
                request_id=f"bind-{sandbox_id}-{lease_id}",
                sandbox_id=sandbox_id,
                lease_id=lease_id,
                owner=owner,
                instance_id=instance_id,
                ttl=duration_pb(ttl_s),
            ),
            10.0,
        )
        return _facts(r.sandbox)

    async def renew(self, sandbox_id: str, ttl_s: float) -> float:
        r = await self._call(
            self._stub.RenewSandbox,
            pb.RenewSandboxRequest(sandbox_id=sandbox_id, ttl=duration_pb(ttl_s)),
            10.0,
        )
        return _facts(r.sandbox).expire_time

    async def destroy(self, sandbox_id: str) -> bool:
        r = await self._call(
            self._stub.DestroySandbox,
            pb.DestroySandboxRequest(request_id=f"destroy-{sandbox_id}", sandbox_id=sandbox_id),
        )
        return bool(r.existed)

    async def fork(self, request: ForkRequest) -> ForkFacts:
        r = await self._call(
            self._stub.ForkSandbox,
            pb.ForkSandboxRequest(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                count=len(request.lease_ids),
                ttl=duration_pb(request.ttl_s),
                labels=dict(request.labels),
                lease_ids=list(request.lease_ids),
                owner=request.owner,
            ),
            metadata=((LEASE_TOKEN_METADATA_KEY, request.lease_token),)
            if request.lease_token
            else None,
        )
        return ForkFacts(r.checkpoint.checkpoint_id, tuple(_facts(s) for s in r.sandboxes))

    async def list_sandboxes(self) -> list[SandboxFacts]:
        r = await self._call(self._stub.ListSandboxes, pb.ListSandboxesRequest(), 30.0)
        return [_facts(s) for s in r.sandboxes]

    async def watch_health(self) -> AsyncIterator[bool]:
        call = self._health_watch(health_pb2.HealthCheckRequest(service=""))
        try:
            async for response in call:
                yield response.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as err:
            raise NodeUnreachable(f"node {self.address}: {err.details()}") from None
        finally:
            call.cancel()
        # The server ended the watch (it is shutting down): as good as unreachable.
        raise NodeUnreachable(f"node {self.address}: health watch ended")

    async def close(self) -> None:
        await self._channel.close()
