"""A small async client for an exec node's SandboxService (used by tools, tests and the agent)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import ParamSpec, cast

import grpc

from swerl.chassis.timeconv import duration_pb as duration
from swerl.exec.outcome import ExecResult
from swerl.exec.settings import DEFAULT_COMMAND_TIMEOUT_S
from swerl.exec.v1 import sandbox_pb2 as pb
from swerl.exec.v1 import sandbox_pb2_grpc

P = ParamSpec("P")

# Options for a channel to an exec node that must hear of the node's fault in seconds: a node
# stopped (SIGSTOP) or cut off answers nothing, and a command's stream is silent while it runs,
# so only pings find out. One every 2 s, answered within 2 s, ends every call in flight on a
# stopped node UNAVAILABLE within ~4 s, not at its 60/120 s deadline. The node accepts pings
# this often (swerl.chassis.server.SERVER_OPTIONS). gRPC core (1.85) bounds the wait for a
# ping's answer by `grpc.http2.ping_timeout_ms` (a minute by default), not by
# `grpc.keepalive_timeout_ms` alone: both are set. A call made once the connection is gone
# waits for a new one, whose attempt a stopped node (its kernel still accepts) never answers:
# gRPC gives up on an attempt after `grpc.min_reconnect_backoff_ms` (20 s by default), so 2 s
# here (and a restarted node is reached again within a second, not after minutes of backoff).
NODE_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.http2.ping_timeout_ms", 2_000),
    ("grpc.min_reconnect_backoff_ms", 2_000),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)


def start_message(
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
) -> pb.ExecStart:
    """One command as the node reads it. Zero (or empty) means the node's default: the cwd is
    the sandbox's workdir, the timeout `ExecSettings.default_timeout_s`, the output cap
    `default_max_output_bytes`; `session` runs it in the sandbox's persistent shell."""
    return pb.ExecStart(
        sandbox_id=sandbox_id,
        command=command,
        cwd=cwd,
        env=env or None,
        timeout=duration(timeout_s) if timeout_s else None,
        max_output_bytes=max_output_bytes,
        mode=pb.EXEC_MODE_SESSION if session else pb.EXEC_MODE_ISOLATED,
        open_stdin=open_stdin,
        notify_started=notify_started,
    )


def _as_request(build: Callable[P, pb.ExecStart]) -> Callable[P, pb.ExecRequest]:
    """An Exec call's first request from a `start` builder, with the builder's own signature."""

    def request(*args: P.args, **kwargs: P.kwargs) -> pb.ExecRequest:
        return pb.ExecRequest(start=build(*args, **kwargs))

    return request


# The `start` request of an Exec call: `start_message`'s arguments, typed as they are there.
exec_start = _as_request(start_message)


async def collect(responses: AsyncIterator[pb.ExecResponse]) -> ExecResult:
    out = {pb.OUTPUT_STREAM_STDOUT: bytearray(), pb.OUTPUT_STREAM_STDERR: bytearray()}
    async for response in responses:
        kind = response.WhichOneof("kind")
        if kind == "output":
            out[response.output.stream] += response.output.data
        elif kind == "exit":
            return _result(response.exit, out)
    raise _ended_without_exit("Exec stream")


def _ended_without_exit(what: str) -> grpc.aio.AioRpcError:
    # A call the node ended cleanly before the command's exit (the node stopping, say) is a
    # transport failure to the caller like any other, not a bug in the caller: UNAVAILABLE.
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        f"{what} ended without an exit message",
    )


def _result(e: pb.ExecExit, out: Mapping[pb.OutputStream, bytearray]) -> ExecResult:
    return ExecResult(
        exit_code=e.exit_code,
        stdout=bytes(out[pb.OUTPUT_STREAM_STDOUT]),
        stderr=bytes(out[pb.OUTPUT_STREAM_STDERR]),
        timed_out=e.timed_out,
        output_truncated=e.output_truncated,
        bytes_dropped=e.bytes_dropped,
        duration_s=e.duration.seconds + e.duration.nanos / 1e9,
        signaled=e.signaled,
        sandbox_restarted=e.sandbox_restarted,
    )


class SandboxClient:
    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float = 60.0) -> None:
        self.stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        self.timeout_s = timeout_s
        self._streams: dict[str, CommandStream] = {}

    async def run(
        self,
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
        deadline_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Runs one command and gathers its output (the arguments of `start_message`; `stdin`:
        bytes for its stdin, then end of file).

        Commands on one sandbox go over one ExecCommands call, kept open between them (see
        `CommandStream`); a failed command raises the node's `grpc.aio.AioRpcError` as an Exec
        call would. The wait is bounded by the command timeout plus a margin unless given
        (DEADLINE_EXCEEDED, and the command is killed)."""
        stream = self._streams.get(sandbox_id)
        if stream is None:
            stream = self._streams[sandbox_id] = CommandStream(self.stub, sandbox_id)
        return await stream.run(
            command,
            cwd=cwd,
            env=env,
            timeout_s=timeout_s,
            max_output_bytes=max_output_bytes,
            session=session,
            open_stdin=open_stdin,
            notify_started=notify_started,
            deadline_s=deadline_s,
            stdin=stdin,
        )

    def commands(
        self,
        sandbox_id: str,
        *,
        deadline_s: float = 3600.0,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> CommandStream:
        """A `CommandStream` of its own on one sandbox: many commands over one call."""
        return CommandStream(self.stub, sandbox_id, deadline_s=deadline_s, metadata=metadata)

    async def aclose(self) -> None:
        """Ends the calls `run` keeps open (closing the channel ends them too)."""
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.aclose()


# Stdin bytes per ExecStdin message.
STDIN_CHUNK_BYTES = 1 << 20
# A command's result is awaited for its timeout plus this margin before the client gives up.
COMMAND_DEADLINE_MARGIN_S = 30.0
# A call is not reused past this age: per-call metadata (a lease's capability token, renewed
# while the lease lives) is read when a call opens, so a fresh call picks up the current one.
# An idle call is half-closed after it, so a client leaves nothing open on a node it stopped
# using.
MAX_CALL_AGE_S = 60.0


class CommandStream:
    """Runs commands on one sandbox, one after another, over one ExecCommands call.

    This is how a client that runs a series of commands (an agent's episode) talks to the node:
    each command costs a message each way instead of a whole call, which on a small node is
    most of the cost of a short command. The call is opened on the first command and opened
    again when it ended (an error), is older than MAX_CALL_AGE_S, or could not outlive the next
    command's deadline. Concurrent `run`s take turns, in arrival order.

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
        self._opened_at = 0.0
        self._call_ends_at = 0.0
        self._turn = asyncio.Lock()
        self._idle: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> CommandStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def run(
        self,
        command: str,
        *,
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        timeout_s: float = 0.0,
        max_output_bytes: int = 0,
        session: bool = False,
        open_stdin: bool = False,
        notify_started: bool = False,
        deadline_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Runs one command and gathers its output (the arguments of `start_message`). A failed
        command raises the call's `grpc.aio.AioRpcError`; the next run opens a new call. The
        wait is bounded by `deadline_s` (default: the command timeout plus a margin). `stdin`:
        bytes the command reads on its stdin, then end of file (exact bytes, no shell quoting;
        the agent's file editor writes files this way)."""
        request = pb.ExecCommandsRequest(
            start=start_message(
                self.sandbox_id,
                command,
                cwd=cwd,
                env=env,
                timeout_s=timeout_s,
                max_output_bytes=max_output_bytes,
                session=session,
                open_stdin=open_stdin or stdin is not None,
                notify_started=notify_started,
            )
        )
        if deadline_s is None:
            deadline_s = (timeout_s or DEFAULT_COMMAND_TIMEOUT_S) + COMMAND_DEADLINE_MARGIN_S
        loop = asyncio.get_running_loop()
        async with self._turn:
            if self._idle is not None:
                self._idle.cancel()
            now = loop.time()
            call = self._call
            if (
                call is None
                or call.done()
                or now - self._opened_at > MAX_CALL_AGE_S
                or now + deadline_s > self._call_ends_at
            ):
                self._retire(call)
                call_timeout = max(self._deadline_s, deadline_s + MAX_CALL_AGE_S)
                call = self._call = self._stub.ExecCommands(
                    metadata=self._metadata, timeout=call_timeout
                )
                self._opened_at, self._call_ends_at = now, now + call_timeout
            expired = False

            def expire() -> None:
                nonlocal expired
                expired = True
                call.cancel()  # kills the command on the node and ends the read below

            timer = loop.call_later(deadline_s, expire)
            try:
                return await self._exchange(call, request, stdin)
            except BaseException as exc:
                # The call's state is unknown (an error ended it, or we stopped reading
                # half-way): never reuse it.
                self._call = None
                call.cancel()
                if expired and isinstance(exc, asyncio.CancelledError):
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.aio.Metadata(),
                        grpc.aio.Metadata(),
                        f"no exit within {deadline_s:g} s",
                    ) from None
                raise
            finally:
                timer.cancel()
                if self._call is not None:
                    self._idle = loop.call_later(MAX_CALL_AGE_S, self._close_idle)

    @staticmethod
    async def _exchange(
        call: grpc.aio.StreamStreamCall, request: pb.ExecCommandsRequest, stdin: bytes | None
    ) -> ExecResult:
        out = {pb.OUTPUT_STREAM_STDOUT: bytearray(), pb.OUTPUT_STREAM_STDERR: bytearray()}
        await call.write(request)
        if stdin is not None:
            # In pieces well under gRPC's default 4 MiB message limit; the last closes stdin.
            pieces = [
                stdin[i : i + STDIN_CHUNK_BYTES] for i in range(0, len(stdin), STDIN_CHUNK_BYTES)
            ]
            for index, piece in enumerate(pieces or [b""]):
                last = index == max(len(pieces), 1) - 1
                await call.write(pb.ExecCommandsRequest(stdin=pb.ExecStdin(data=piece, close=last)))
        while True:
            read = await call.read()
            if read is grpc.aio.EOF:
                raise _ended_without_exit("ExecCommands call")
            message = cast(pb.ExecCommandsResponse, read)
            kind = message.WhichOneof("kind")
            if kind == "output":
                out[message.output.stream] += message.output.data
            elif kind == "exit":
                return _result(message.exit, out)
            elif kind == "end":
                for chunk in message.end.output:
                    out[chunk.stream] += chunk.data
                return _result(message.end.exit, out)

    def _retire(self, call: grpc.aio.StreamStreamCall | None) -> None:
        """Half-closes an idle call in the background (the node then ends it)."""
        self._call = None
        if call is None or call.done():
            return
        task = asyncio.get_running_loop().create_task(_half_close(call))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _close_idle(self) -> None:
        self._idle = None
        if not self._turn.locked():
            self._retire(self._call)

    async def aclose(self) -> None:
        """Half-closes the call and waits for it to end."""
        if self._idle is not None:
            self._idle.cancel()
        call, self._call = self._call, None
        if call is not None:
            await _half_close(call)
        for task in list(self._closing):
            with contextlib.suppress(BaseException):
                await task


async def _half_close(call: grpc.aio.StreamStreamCall) -> None:
    if call.done():
        return
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
