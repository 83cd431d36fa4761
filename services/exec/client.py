"""A small async client for an exec node's SandboxService (used by tools, tests and the agent)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc

from swerl.chassis.timeconv import duration_pb as duration
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.exec.v1 import sandbox_pb2_grpc


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_truncated: bool
    bytes_dropped: int
    duration_s: float
    signaled: bool

    @property
    def output(self) -> bytes:
        """stdout then stderr (the order of interleaving is not kept across streams)."""
        return self.stdout + self.stderr


def exec_start(
    sandbox_id: str,
    command: str,
    *,
    cwd: str = "",
    env: Mapping[str, str] | None = None,
    timeout_s: float = 0.0,
    max_output_bytes: int = 0,
    session: bool = False,
    open_stdin: bool = False,
    notify_started: bool = False,
) -> pb.ExecRequest:
    return pb.ExecRequest(
        start=pb.ExecStart(
            sandbox_id=sandbox_id,
            command=command,
            cwd=cwd,
            env=dict(env or {}),
            timeout=duration(timeout_s),
            max_output_bytes=max_output_bytes,
            mode=pb.EXEC_MODE_SESSION if session else pb.EXEC_MODE_ISOLATED,
            open_stdin=open_stdin,
            notify_started=notify_started,
        )
    )


async def collect(responses: AsyncIterator[pb.ExecResponse]) -> ExecResult:
    out = {pb.OUTPUT_STREAM_STDOUT: bytearray(), pb.OUTPUT_STREAM_STDERR: bytearray()}
    async for response in responses:
        kind = response.WhichOneof("kind")
        if kind == "output":
            out[response.output.stream] += response.output.data
        elif kind == "exit":
            return _result(response.exit, out)
    raise RuntimeError("Exec stream ended without an exit message")


def _result(e: pb.ExecExit, out: Mapping[int, bytearray]) -> ExecResult:
    return ExecResult(
        exit_code=e.exit_code,
        stdout=bytes(out[pb.OUTPUT_STREAM_STDOUT]),
        stderr=bytes(out[pb.OUTPUT_STREAM_STDERR]),
        timed_out=e.timed_out,
        output_truncated=e.output_truncated,
        bytes_dropped=e.bytes_dropped,
        duration_s=e.duration.seconds + e.duration.nanos / 1e9,
        signaled=e.signaled,
    )


class SandboxClient:
    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float = 60.0) -> None:
        self.stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        self.timeout_s = timeout_s

    async def run(
        self, sandbox_id: str, command: str, *, deadline_s: float | None = None, **kwargs
    ) -> ExecResult:
        """Runs one command and gathers its output. The RPC deadline is the command timeout
        plus a margin unless given."""
        timeout = kwargs.get("timeout_s") or 180.0
        call = self.stub.Exec(
            iter([exec_start(sandbox_id, command, **kwargs)]),
            timeout=deadline_s if deadline_s is not None else timeout + 30.0,
        )
        return await collect(call)

    def commands(
        self,
        sandbox_id: str,
        *,
        deadline_s: float = 3600.0,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> CommandStream:
        """A `CommandStream` on one sandbox: many commands over one call."""
        return CommandStream(self.stub, sandbox_id, deadline_s=deadline_s, metadata=metadata)


class CommandStream:
    """Runs commands on one sandbox, one after another, over one ExecCommands call.

    This is how a client that runs a series of commands (an agent's episode) should talk to
    the node: each command costs a message each way instead of a whole call, which on a small
    node is most of the cost of a short command. The call is opened on the first command and
    opened again after it ended (an error, or its deadline between commands).

        async with client.commands(sandbox_id) as shell:
            result = await shell.run("pytest -x", timeout_s=600)
    """

    def __init__(
        self,
        stub: sandbox_pb2_grpc.SandboxServiceStub,
        sandbox_id: str,
        *,
        deadline_s: float = 3600.0,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self._stub = stub
        self.sandbox_id = sandbox_id
        self._deadline_s = deadline_s
        self._metadata = metadata
        self._call: grpc.aio.StreamStreamCall | None = None

    async def __aenter__(self) -> CommandStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def run(self, command: str, **kwargs) -> ExecResult:
        """Runs one command and gathers its output (the arguments of `exec_start`). A failed
        command raises the call's `grpc.aio.AioRpcError`; the next run opens a new call."""
        start = exec_start(self.sandbox_id, command, **kwargs).start
        call = self._call
        if call is None or call.done():
            call = self._call = self._stub.ExecCommands(
                metadata=self._metadata, timeout=self._deadline_s
            )
        out = {pb.OUTPUT_STREAM_STDOUT: bytearray(), pb.OUTPUT_STREAM_STDERR: bytearray()}
        try:
            await call.write(pb.ExecCommandsRequest(start=start))
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise RuntimeError("ExecCommands call ended without an exit message")
                kind = message.WhichOneof("kind")
                if kind == "output":
                    out[message.output.stream] += message.output.data
                elif kind == "exit":
                    return _result(message.exit, out)
        except BaseException:
            # The call's state is unknown (an error ended it, or we stopped reading half-way):
            # never reuse it.
            self._call = None
            call.cancel()
            raise

    async def aclose(self) -> None:
        """Half-closes the call and waits for it to end (the node ends it once idle)."""
        call, self._call = self._call, None
        if call is not None and not call.done():
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call.done_writing()
                async for _ in call:
                    pass
