"""A small async client for an exec node's SandboxService (used by tools, tests and the agent)."""

from __future__ import annotations

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
            e = response.exit
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
    raise RuntimeError("Exec stream ended without an exit message")


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
