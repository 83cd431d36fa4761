"""SandboxService: protos in, domain calls, protos out. No logic, logging or settings here."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from swerl.chassis.timeconv import duration_pb, seconds_of, timestamp_pb
from swerl.exec.capability import require_lease_token
from swerl.exec.errors import EmptyCommand, ExecStartRequired, StdinNotOpen
from swerl.exec.sandboxes import CreateSpec, ImageEvent, Resources, SandboxManager, SandboxRecord
from swerl.exec.shell import CommandRun, CommandSpec, Exit, Output, Started
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.exec.v1 import sandbox_pb2_grpc

_NETWORK_TO_DOMAIN = {
    pb.NETWORK_MODE_UNSPECIFIED: "none",
    pb.NETWORK_MODE_NONE: "none",
    pb.NETWORK_MODE_BRIDGE: "bridge",
}
_NETWORK_TO_PB = {"none": pb.NETWORK_MODE_NONE, "bridge": pb.NETWORK_MODE_BRIDGE}
# How long output waits for the command's exit to travel with it (ExecCommands): long enough
# for a short command's end marker to follow its output, too short to notice in a live stream.
_OUTPUT_LINGER_S = 0.002
_SIGNALS = {pb.SIGNAL_INT: "INT", pb.SIGNAL_TERM: "TERM", pb.SIGNAL_KILL: "KILL"}
_PULL_STATUS = {
    "PRESENT": pb.IMAGE_PULL_STATUS_PRESENT,
    "PULLED": pb.IMAGE_PULL_STATUS_PULLED,
    "FAILED": pb.IMAGE_PULL_STATUS_FAILED,
}


def sandbox_to_pb(record: SandboxRecord, node_id: str) -> pb.Sandbox:
    return pb.Sandbox(
        sandbox_id=record.sandbox_id,
        image=record.image,
        workdir=record.workdir,
        state=pb.SANDBOX_STATE_RUNNING if record.running else pb.SANDBOX_STATE_EXITED,
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
        network=_NETWORK_TO_PB.get(record.network, pb.NETWORK_MODE_NONE),
        node_id=node_id,
    )


def _command_spec(start: pb.ExecStart) -> CommandSpec:
    return CommandSpec(
        command=start.command,
        cwd=start.cwd,
        env=dict(start.env),
        timeout_s=seconds_of(start.timeout),
        max_output_bytes=start.max_output_bytes,
        session=start.mode == pb.EXEC_MODE_SESSION,
        open_stdin=start.open_stdin,
        notify_started=start.notify_started,
    )


def _exit_pb(event: Exit) -> pb.ExecExit:
    return pb.ExecExit(
        exit_code=event.exit_code,
        timed_out=event.timed_out,
        output_truncated=event.output_truncated,
        duration=duration_pb(event.duration_s),
        bytes_dropped=event.bytes_dropped,
        signaled=event.signaled,
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, manager: SandboxManager) -> None:
        self._m = manager

    @property
    def _node(self) -> str:
        return self._m.settings.node_id

    async def CreateSandbox(
        self, request: pb.CreateSandboxRequest, context
    ) -> pb.CreateSandboxResponse:
        res = request.resources
        record = await self._m.create(
            CreateSpec(
                image=request.image,
                request_id=request.request_id,
                workdir=request.workdir,
                env=dict(request.env),
                resources=Resources(res.cpus, res.memory_bytes, res.pids),
                network=_NETWORK_TO_DOMAIN.get(request.network, "invalid"),
                labels=dict(request.labels),
                ttl_s=seconds_of(request.ttl),
                lease_id=request.lease_id,
                owner=request.owner,
                instance_id=request.instance_id,
            )
        )
        return pb.CreateSandboxResponse(sandbox=sandbox_to_pb(record, self._node))

    async def GetSandbox(self, request: pb.GetSandboxRequest, context) -> pb.GetSandboxResponse:
        return pb.GetSandboxResponse(
            sandbox=sandbox_to_pb(self._m.get(request.sandbox_id), self._node)
        )

    async def Exec(
        self, request_iterator: AsyncIterator[pb.ExecRequest], context
    ) -> AsyncIterator[pb.ExecResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "start":
            raise ExecStartRequired("the first Exec message must be `start`")
        start = first.start
        require_lease_token(self._m, context, start.sandbox_id)
        if not start.command.strip():
            raise EmptyCommand("command is empty", sandbox_id=start.sandbox_id)
        run = self._m.start_command(start.sandbox_id, _command_spec(start))
        inputs = asyncio.get_running_loop().create_task(
            self._pump_inputs(request_iterator, run, start.open_stdin)
        )
        finished = False
        try:
            async for event in run.events():
                if isinstance(event, Output):
                    yield pb.ExecResponse(
                        output=pb.ExecOutput(stream=event.stream, data=event.data)
                    )
                elif isinstance(event, Started):
                    yield pb.ExecResponse(started=pb.ExecStarted(pgid=event.pgid))
                elif isinstance(event, Exit):
                    finished = True
                    if inputs.done() and not inputs.cancelled() and inputs.exception():
                        raise inputs.exception()  # e.g. StdinNotOpen: the call fails with it
                    yield pb.ExecResponse(
                        exit=pb.ExecExit(
                            exit_code=event.exit_code,
                            timed_out=event.timed_out,
                            output_truncated=event.output_truncated,
                            duration=duration_pb(event.duration_s),
                            bytes_dropped=event.bytes_dropped,
                            signaled=event.signaled,
                        )
                    )
        finally:
            if not finished:
                run.abandon()
            inputs.cancel()
            with contextlib.suppress(BaseException):
                await inputs

    @staticmethod
    async def _pump_inputs(requests: AsyncIterator[pb.ExecRequest], run, open_stdin: bool) -> None:
        async for message in requests:
            kind = message.WhichOneof("kind")
            if kind == "signal":
                signal = _SIGNALS.get(message.signal.signal)
                if signal is not None:
                    run.request_signal(signal)
            elif kind == "stdin":
                if not open_stdin:
                    # A protocol error fails the whole call and, like a cancel, kills the command.
                    run.request_signal("KILL")
                    raise StdinNotOpen("stdin was not opened (set start.open_stdin)")
                await run.write_stdin(message.stdin.data, message.stdin.close)

    async def ExecCommands(
        self, request_iterator: AsyncIterator[pb.ExecCommandsRequest], context
    ) -> AsyncIterator[pb.ExecCommandsResponse]:
        # The reader turns each `start` into a run (or the error that ends the call) and queues
        # it; this loop runs them one after another and streams their events.
        queued: asyncio.Queue[CommandRun | Exception | None] = asyncio.Queue()
        unfinished: collections.deque[CommandRun] = collections.deque()
        reader = asyncio.get_running_loop().create_task(
            self._read_commands(request_iterator, context, queued, unfinished)
        )
        try:
            while True:
                item = await queued.get()
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                # Output already followed by the exit (the run has finished) goes out with the
                # exit in one `end` message: one write instead of two for a short command. The
                # last chunk seen while the command runs waits a moment for that exit.
                last: list[pb.ExecOutput] = []
                async for event in item.events():
                    if isinstance(event, Output):
                        chunk = pb.ExecOutput(stream=event.stream, data=event.data)
                        if not item.finished and not item.events_waiting:
                            await item.settle(_OUTPUT_LINGER_S)
                        if item.finished:
                            last.append(chunk)
                        else:
                            yield pb.ExecCommandsResponse(output=chunk)
                    elif isinstance(event, Exit):
                        if last:
                            end = pb.ExecCommandEnd(output=last, exit=_exit_pb(event))
                            yield pb.ExecCommandsResponse(end=end)
                        else:
                            yield pb.ExecCommandsResponse(exit=_exit_pb(event))
                    else:
                        yield pb.ExecCommandsResponse(started=pb.ExecStarted(pgid=event.pgid))
        finally:
            for run in unfinished:
                run.abandon()
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader

    async def _read_commands(
        self,
        requests: AsyncIterator[pb.ExecCommandsRequest],
        context,
        queued: asyncio.Queue[CommandRun | Exception | None],
        unfinished: collections.deque[CommandRun],
    ) -> None:
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "start":
                    start = message.start
                    require_lease_token(self._m, context, start.sandbox_id)
                    if not start.command.strip():
                        raise EmptyCommand("command is empty", sandbox_id=start.sandbox_id)
                    run = self._m.start_command(start.sandbox_id, _command_spec(start))
                    unfinished.append(run)
                    queued.put_nowait(run)
                    continue
                while unfinished and unfinished[0].finished:
                    unfinished.popleft()
                target = unfinished[0] if unfinished else None
                if kind == "signal":
                    signal = _SIGNALS.get(message.signal.signal)
                    if signal is not None and target is not None:
                        target.request_signal(signal)
                elif kind == "stdin":
                    if target is None or not target.spec.open_stdin:
                        if target is not None:
                            target.request_signal("KILL")
                        raise StdinNotOpen("stdin was not opened (set start.open_stdin)")
                    await target.write_stdin(message.stdin.data, message.stdin.close)
        except Exception as exc:  # ends the call once the commands queued before it are done
            queued.put_nowait(exc)
        else:
            queued.put_nowait(None)

    async def GetDiff(self, request: pb.GetDiffRequest, context) -> pb.GetDiffResponse:
        require_lease_token(self._m, context, request.sandbox_id)
        result = await self._m.diff(
            request.sandbox_id, request.base_ref, request.include_untracked, request.path
        )
        return pb.GetDiffResponse(
            patch=result.patch, files=result.files, base_commit=result.base_commit
        )

    async def RenewSandbox(
        self, request: pb.RenewSandboxRequest, context
    ) -> pb.RenewSandboxResponse:
        record = await self._m.renew(request.sandbox_id, seconds_of(request.ttl))
        return pb.RenewSandboxResponse(sandbox=sandbox_to_pb(record, self._node))

    async def BindSandbox(self, request: pb.BindSandboxRequest, context) -> pb.BindSandboxResponse:
        record = await self._m.bind(
            request.sandbox_id,
            request.lease_id,
            request.owner,
            request.instance_id,
            seconds_of(request.ttl),
        )
        return pb.BindSandboxResponse(sandbox=sandbox_to_pb(record, self._node))

    async def DestroySandbox(
        self, request: pb.DestroySandboxRequest, context
    ) -> pb.DestroySandboxResponse:
        return pb.DestroySandboxResponse(existed=await self._m.destroy(request.sandbox_id))

    async def ListSandboxes(
        self, request: pb.ListSandboxesRequest, context
    ) -> pb.ListSandboxesResponse:
        records = self._m.list(dict(request.label_selector))
        return pb.ListSandboxesResponse(sandboxes=[sandbox_to_pb(r, self._node) for r in records])

    async def GetNodeInfo(self, request: pb.GetNodeInfoRequest, context) -> pb.GetNodeInfoResponse:
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
        )

    async def ListImages(self, request: pb.ListImagesRequest, context) -> pb.ListImagesResponse:
        rows = await self._m.list_images()
        return pb.ListImagesResponse(
            images=[
                pb.Image(
                    image_id=row.get("Id", ""),
                    repo_tags=[t for t in row.get("RepoTags") or [] if t != "<none>:<none>"],
                    size_bytes=int(row.get("Size", 0) or 0),
                    create_time=timestamp_pb(float(row.get("Created", 0) or 0)),
                )
                for row in rows
            ]
        )

    async def EnsureImages(
        self, request: pb.EnsureImagesRequest, context
    ) -> AsyncIterator[pb.EnsureImagesResponse]:
        events = self._m.ensure_images(
            list(request.images), request.mirror_prefix, request.concurrency or 4
        )
        async for event in events:
            yield _image_event_to_pb(event)


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
            status=_PULL_STATUS[event.status],
            reason=event.reason,
            message=event.message,
            duration=duration_pb(event.duration_s),
        )
    )
