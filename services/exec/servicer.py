"""SandboxService: protos in, domain calls, protos out. No logic, logging or settings here.

Enums cross through the explicit tables below; commands go through swerl.exec.commands.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from swerl.chassis.timeconv import duration_pb, seconds_of, timestamp_pb
from swerl.exec.capability import lease_token, require_lease_token
from swerl.exec.commands import (
    CommandEnd,
    CommandInput,
    CommandStdin,
    SignalCommand,
    StartCommand,
    run_command,
    run_commands,
)
from swerl.exec.forks import Checkpoint, ForkManager
from swerl.exec.harness_host import HarnessHost
from swerl.exec.image_ensure import ImageEvent
from swerl.exec.images import CachedImage
from swerl.exec.output import STDERR, STDOUT
from swerl.exec.sandboxes import CreateSpec, Resources, SandboxManager, SandboxRecord
from swerl.exec.shell import CommandSpec, Exit, Output
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.exec.v1 import sandbox_pb2_grpc

# -- enum tables: every pb enum value the node reads or writes, in one place (a test checks
# -- that each covers its whole enum and the domain's values).
NETWORK_TO_DOMAIN: dict[pb.NetworkMode, str] = {
    pb.NETWORK_MODE_UNSPECIFIED: "none",
    pb.NETWORK_MODE_NONE: "none",
    pb.NETWORK_MODE_BRIDGE: "bridge",
    pb.NETWORK_MODE_HOST: "host",
}
NETWORK_TO_PB: dict[str, pb.NetworkMode] = {
    "none": pb.NETWORK_MODE_NONE,
    "bridge": pb.NETWORK_MODE_BRIDGE,
    "host": pb.NETWORK_MODE_HOST,
}
# Whether a command runs in the sandbox's session (True) or isolated from it.
SESSION_OF_MODE: dict[pb.ExecMode, bool] = {
    pb.EXEC_MODE_UNSPECIFIED: False,
    pb.EXEC_MODE_ISOLATED: False,
    pb.EXEC_MODE_SESSION: True,
}
# SIGNAL_UNSPECIFIED is absent: such a signal message is ignored.
SIGNAL_TO_DOMAIN: dict[pb.Signal, str] = {
    pb.SIGNAL_INT: "INT",
    pb.SIGNAL_TERM: "TERM",
    pb.SIGNAL_KILL: "KILL",
}
OUTPUT_STREAM_TO_PB: dict[int, pb.OutputStream] = {
    STDOUT: pb.OUTPUT_STREAM_STDOUT,
    STDERR: pb.OUTPUT_STREAM_STDERR,
}
# Keyed by SandboxRecord.running.
SANDBOX_STATE_TO_PB: dict[bool, pb.SandboxState] = {
    True: pb.SANDBOX_STATE_RUNNING,
    False: pb.SANDBOX_STATE_EXITED,
}
PULL_STATUS_TO_PB: dict[str, pb.ImagePullStatus] = {
    "PRESENT": pb.IMAGE_PULL_STATUS_PRESENT,
    "PULLED": pb.IMAGE_PULL_STATUS_PULLED,
    "FAILED": pb.IMAGE_PULL_STATUS_FAILED,
}


def sandbox_to_pb(record: SandboxRecord, node_id: str) -> pb.Sandbox:
    return pb.Sandbox(
        sandbox_id=record.sandbox_id,
        image=record.image,
        workdir=record.workdir,
        state=SANDBOX_STATE_TO_PB[record.running],
        labels=record.labels,
        create_time=timestamp_pb(record.create_time),
        expire_time=timestamp_pb(record.expire_time),
        lease_id=record.lease_id,
        owner=record.owner,
        instance_id=record.instance_id,
        resources=pb.Resources(
            cpus=record.resources.cpus,
            memory_bytes=record.resources.memory_bytes,
            pids=record.resources.pids,
        ),
        network=NETWORK_TO_PB.get(record.network, pb.NETWORK_MODE_NONE),
        node_id=node_id,
        checkpoint_id=record.checkpoint_id,
    )


def checkpoint_to_pb(checkpoint: Checkpoint, in_use: int) -> pb.Checkpoint:
    # A ForkSandbox fork point ends when it is made (it lives on in its copies only).
    ended_at_birth = checkpoint.expire_time <= checkpoint.create_time
    return pb.Checkpoint(
        checkpoint_id=checkpoint.checkpoint_id,
        name=checkpoint.name,
        source_sandbox_id=checkpoint.source_sandbox_id,
        image=checkpoint.image,
        fork_image=checkpoint.fork_image,
        create_time=timestamp_pb(checkpoint.create_time),
        expire_time=None if ended_at_birth else timestamp_pb(checkpoint.expire_time),
        sandboxes=in_use,
        size_bytes=checkpoint.size_bytes,
        labels=checkpoint.labels,
    )


def _command_input(message: pb.ExecRequest | pb.ExecCommandsRequest) -> CommandInput | None:
    """One Exec or ExecCommands request message as the command pipeline's input."""
    kind = message.WhichOneof("kind")
    if kind == "start":
        start = message.start
        return StartCommand(
            start.sandbox_id,
            CommandSpec(
                command=start.command,
                cwd=start.cwd,
                env=dict(start.env),
                timeout_s=seconds_of(start.timeout),
                max_output_bytes=start.max_output_bytes,
                session=SESSION_OF_MODE.get(start.mode, False),
                open_stdin=start.open_stdin,
                notify_started=start.notify_started,
            ),
        )
    if kind == "signal":
        signal = SIGNAL_TO_DOMAIN.get(message.signal.signal)
        return SignalCommand(signal) if signal is not None else None
    if kind == "stdin":
        return CommandStdin(message.stdin.data, message.stdin.close)
    return None


def _output_pb(event: Output) -> pb.ExecOutput:
    return pb.ExecOutput(stream=OUTPUT_STREAM_TO_PB[event.stream], data=event.data)


def _exit_pb(event: Exit) -> pb.ExecExit:
    """The one ExecExit builder (Exec and ExecCommands)."""
    return pb.ExecExit(
        exit_code=event.exit_code,
        timed_out=event.timed_out,
        output_truncated=event.output_truncated,
        duration=duration_pb(event.duration_s),
        bytes_dropped=event.bytes_dropped,
        signaled=event.signaled,
        sandbox_restarted=event.sandbox_restarted,
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, manager: SandboxManager, forks: ForkManager, harnesses: HarnessHost) -> None:
        self._m = manager
        self._forks = forks
        self._harnesses = harnesses

    @property
    def _node(self) -> str:
        return self._m.settings.node_id

    async def CreateSandbox(
        self, request: pb.CreateSandboxRequest, context: Any
    ) -> pb.CreateSandboxResponse:
        res = request.resources
        create = (
            (lambda spec: self._forks.create_from(request.from_checkpoint, spec))
            if request.from_checkpoint
            else self._m.create
        )
        record = await create(
            CreateSpec(
                image=request.image,
                request_id=request.request_id,
                workdir=request.workdir,
                env=dict(request.env),
                resources=Resources(res.cpus, res.memory_bytes, res.pids),
                network=NETWORK_TO_DOMAIN.get(request.network, "invalid"),
                labels=dict(request.labels),
                ttl_s=seconds_of(request.ttl),
                lease_id=request.lease_id,
                owner=request.owner,
                instance_id=request.instance_id,
            )
        )
        return pb.CreateSandboxResponse(sandbox=sandbox_to_pb(record, self._node))

    async def GetSandbox(
        self, request: pb.GetSandboxRequest, context: Any
    ) -> pb.GetSandboxResponse:
        return pb.GetSandboxResponse(
            sandbox=sandbox_to_pb(await self._m.observe(request.sandbox_id), self._node)
        )

    async def Exec(
        self, request_iterator: AsyncIterator[pb.ExecRequest], context: Any
    ) -> AsyncIterator[pb.ExecResponse]:
        events = run_command(
            self._m, request_iterator, _command_input, lease_token(self._m, context)
        )
        async for event in events:
            if isinstance(event, Output):
                yield pb.ExecResponse(output=_output_pb(event))
            elif isinstance(event, Exit):
                yield pb.ExecResponse(exit=_exit_pb(event))
            else:
                yield pb.ExecResponse(started=pb.ExecStarted(pgid=event.pgid))

    async def ExecCommands(
        self, request_iterator: AsyncIterator[pb.ExecCommandsRequest], context: Any
    ) -> AsyncIterator[pb.ExecCommandsResponse]:
        events = run_commands(
            self._m, request_iterator, _command_input, lease_token(self._m, context)
        )
        async for event in events:
            if isinstance(event, Output):
                yield pb.ExecCommandsResponse(output=_output_pb(event))
            elif isinstance(event, CommandEnd):
                end = pb.ExecCommandEnd(
                    output=[_output_pb(chunk) for chunk in event.output], exit=_exit_pb(event.exit)
                )
                yield pb.ExecCommandsResponse(end=end)
            elif isinstance(event, Exit):
                yield pb.ExecCommandsResponse(exit=_exit_pb(event))
            else:
                yield pb.ExecCommandsResponse(started=pb.ExecStarted(pgid=event.pgid))

    async def GetDiff(self, request: pb.GetDiffRequest, context: Any) -> pb.GetDiffResponse:
        require_lease_token(self._m, context, request.sandbox_id)
        result = await self._m.diff(
            request.sandbox_id, request.base_ref, request.include_untracked, request.path
        )
        return pb.GetDiffResponse(
            patch=result.patch, files=result.files, base_commit=result.base_commit
        )

    async def RenewSandbox(
        self, request: pb.RenewSandboxRequest, context: Any
    ) -> pb.RenewSandboxResponse:
        record = await self._m.renew(request.sandbox_id, seconds_of(request.ttl))
        return pb.RenewSandboxResponse(sandbox=sandbox_to_pb(record, self._node))

    async def BindSandbox(
        self, request: pb.BindSandboxRequest, context: Any
    ) -> pb.BindSandboxResponse:
        record = await self._m.bind(
            request.sandbox_id,
            request.lease_id,
            request.owner,
            request.instance_id,
            seconds_of(request.ttl),
        )
        return pb.BindSandboxResponse(sandbox=sandbox_to_pb(record, self._node))

    async def DestroySandbox(
        self, request: pb.DestroySandboxRequest, context: Any
    ) -> pb.DestroySandboxResponse:
        return pb.DestroySandboxResponse(existed=await self._m.destroy(request.sandbox_id))

    async def ListSandboxes(
        self, request: pb.ListSandboxesRequest, context: Any
    ) -> pb.ListSandboxesResponse:
        records = await self._m.observe_all(dict(request.label_selector))
        return pb.ListSandboxesResponse(sandboxes=[sandbox_to_pb(r, self._node) for r in records])

    async def GetNodeInfo(
        self, request: pb.GetNodeInfoRequest, context: Any
    ) -> pb.GetNodeInfoResponse:
        info = await self._m.node_info()
        return pb.GetNodeInfoResponse(
            node_id=info.node_id,
            version=info.version,
            capacity=info.capacity,
            running=info.running,
            docker_healthy=info.docker_healthy,
            docker_version=info.docker_version,
            docker_error=info.docker_error,
            cpus=info.cpus,
            memory_bytes=info.memory_bytes,
            image_budget_bytes=info.image_budget_bytes,
            image_used_bytes=info.image_used_bytes,
            images_cached=info.images_cached,
        )

    async def ListImages(
        self, request: pb.ListImagesRequest, context: Any
    ) -> pb.ListImagesResponse:
        images = await self._m.list_images()
        return pb.ListImagesResponse(images=[_image_to_pb(image) for image in images])

    async def EnsureImages(
        self, request: pb.EnsureImagesRequest, context: Any
    ) -> AsyncIterator[pb.EnsureImagesResponse]:
        events = self._m.ensure_images(
            list(request.images), request.mirror_prefix, request.concurrency or 4
        )
        async for event in events:
            yield _image_event_to_pb(event)

    async def ForkSandbox(
        self, request: pb.ForkSandboxRequest, context: Any
    ) -> pb.ForkSandboxResponse:
        require_lease_token(self._m, context, request.sandbox_id)
        result = await self._forks.fork(
            request.sandbox_id,
            request.count,
            request_id=request.request_id,
            ttl_s=seconds_of(request.ttl),
            labels=dict(request.labels),
            lease_ids=list(request.lease_ids),
            owner=request.owner,
        )
        return pb.ForkSandboxResponse(
            sandboxes=[sandbox_to_pb(r, self._node) for r in result.sandboxes],
            checkpoint=checkpoint_to_pb(
                result.checkpoint, self._forks.in_use(result.checkpoint.checkpoint_id)
            ),
        )

    async def CheckpointSandbox(
        self, request: pb.CheckpointSandboxRequest, context: Any
    ) -> pb.CheckpointSandboxResponse:
        require_lease_token(self._m, context, request.sandbox_id)
        checkpoint = await self._forks.checkpoint(
            request.sandbox_id,
            request_id=request.request_id,
            name=request.name,
            ttl_s=seconds_of(request.ttl),
            labels=dict(request.labels),
        )
        return pb.CheckpointSandboxResponse(
            checkpoint=checkpoint_to_pb(checkpoint, self._forks.in_use(checkpoint.checkpoint_id))
        )

    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, context: Any
    ) -> pb.ListCheckpointsResponse:
        return pb.ListCheckpointsResponse(
            checkpoints=[
                checkpoint_to_pb(c, self._forks.in_use(c.checkpoint_id))
                for c in self._forks.list_checkpoints()
            ]
        )

    async def DeleteCheckpoint(
        self, request: pb.DeleteCheckpointRequest, context: Any
    ) -> pb.DeleteCheckpointResponse:
        return pb.DeleteCheckpointResponse(existed=await self._forks.delete(request.checkpoint_id))

    async def OpenHarness(
        self, request: pb.OpenHarnessRequest, context: Any
    ) -> pb.OpenHarnessResponse:
        require_lease_token(self._m, context, request.sandbox_id)
        opened = await self._harnesses.open(
            request.sandbox_id,
            request.harness,
            request.version,
            request.gateway_url,
            request.gateway_api_key,
        )
        return pb.OpenHarnessResponse(
            bundle_dir=opened.bundle_dir,
            node=opened.node,
            harness_binary=opened.harness_binary,
            forwarder=opened.forwarder,
            gateway_socket=opened.gateway_socket,
            version=opened.version,
        )


def _image_to_pb(image: CachedImage) -> pb.Image:
    return pb.Image(
        image_id=image.image_id,
        repo_tags=image.repo_tags,
        size_bytes=image.size_bytes,
        create_time=timestamp_pb(image.create_time),
        last_use_time=timestamp_pb(image.last_use_time) if image.last_use_time else None,
        pinned=image.pinned,
        in_use_count=image.in_use_count,
        cached=image.cached,
        use_count=image.use_count,
        checkpoint_id=image.checkpoint_id,
    )


def _image_event_to_pb(event: ImageEvent) -> pb.EnsureImagesResponse:
    if not event.final:
        return pb.EnsureImagesResponse(
            progress=pb.ImagePullProgress(
                image=event.image,
                status=event.status,
                current_bytes=event.current_bytes,
                total_bytes=event.total_bytes,
            )
        )
    return pb.EnsureImagesResponse(
        result=pb.ImagePullResult(
            image=event.image,
            status=PULL_STATUS_TO_PB[event.status],
            reason=event.reason,
            message=event.message,
            duration=duration_pb(event.duration_s),
            size_bytes=event.size_bytes,
            evicted_images=event.evicted,
        )
    )
