"""E2B processes of one sandbox, each detached from the sandbox's command queue.

A process gets its pid from the face at once (so `commands.run(..., background=True)` returns
before the node runs it); its output, its end and its errors are kept as E2B process events that
the Start stream and any later Connect stream follow.

Commands on one swerl sandbox run one at a time on its node, so a process is not run as one of
them: a short launch command starts it as a job of its own in the sandbox (its own process
group, stdout/stderr/exit status in files, stdin through a FIFO; the bash is `swerl.e2b.scripts`)
and the face follows it with short poll commands that read its files from the offsets already
seen, a bounded amount per poll. A long or background process therefore never holds the queue:
later foreground and background processes start and end while it runs. A kill (or the
process's timeout) kills its whole group; a process killed from inside the sandbox (no status
written) ends when a poll finds its shell gone, as envd reports a SIGKILLed process. A
process's files are removed soon after it has ended and its output is read (in batches, off a
quick command's path), and the container takes everything else with it when the sandbox ends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from swerl.chassis.bounded import within
from swerl.e2b.connect import ConnectError
from swerl.e2b.scripts import (
    INLINE_READ_BYTES,
    cleanup_command,
    job_spec,
    kill_command,
    launch_command,
    poll_command,
    stdin_command,
)
from swerl.exec.client import start_message
from swerl.exec.v1 import sandbox_pb2 as pb

# The longest a face command could run, from which the ExecCommands call's deadline is set.
UNBOUNDED_COMMAND_S = 7 * 24 * 3600.0


class ExecTarget(Protocol):
    """Where a sandbox's commands go: its node's SandboxService stub and the current token."""

    @property
    def sandbox_id(self) -> str: ...

    def exec_call(self, timeout_s: float) -> Any: ...

    def commands_call(self, timeout_s: float) -> Any: ...


@dataclass
class ProcessConfig:
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None

    def as_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"cmd": self.cmd, "args": self.args, "envs": self.envs}
        if self.cwd is not None:
            body["cwd"] = self.cwd
        return body


# What envd's end event says of a process a SIGKILL ended (Go's ProcessState.String()).
SIGNAL_KILLED = "signal: killed"
# envd's end of a process a signal killed (Go's ProcessState for a signal death: exit code -1,
# not exited, status and cmd.Wait's error `signal: killed`), whoever sent the signal.
SIGNAL_KILLED_END: dict[str, Any] = {
    "exitCode": -1,
    "exited": False,
    "status": SIGNAL_KILLED,
    "error": SIGNAL_KILLED,
}

# The pause between two polls of a running process's files: short while output comes, growing
# while it is quiet.
POLL_MIN_S = 0.01
POLL_MAX_S = 0.2
# Ended processes whose files wait for removal: removed by the next poll or kill, or by a
# cleanup command once the lane has been idle CLEANUP_IDLE_S (or holds CLEANUP_MAX of them).
CLEANUP_IDLE_S = 0.05
CLEANUP_MAX = 200
# A running process's output files (on the sandbox's /dev/shm, i.e. memory) are freed up to
# what the face has read once that is this much more than what was freed before.
FREE_EVERY_BYTES = 1 << 20


@dataclass
class Process:
    pid: int
    tag: str | None
    config: ProcessConfig
    deadline: float | None  # monotonic
    events: list[dict[str, Any]] = field(default_factory=list)
    error: ConnectError | None = None
    ended: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    stdin_open: bool = False
    killed: bool = False
    kill_sent: bool = False  # its group was killed (a report said `K`)
    start: Any = None  # the ExecStart of its launch command
    out_read: int = 0  # bytes of its stdout file already emitted
    err_read: int = 0
    out_freed: int = 0  # bytes of its stdout file punched out (read, so no longer kept)
    err_freed: int = 0

    def info(self) -> dict[str, Any]:
        body: dict[str, Any] = {"config": self.config.as_json(), "pid": self.pid}
        if self.tag is not None:
            body["tag"] = self.tag
        return body

    async def _emit(self, event: dict[str, Any] | None, error: ConnectError | None = None) -> None:
        async with self.changed:
            if event is not None:
                self.events.append(event)
            if error is not None:
                self.error = error
            if event is None or "end" in event:
                self.ended = True
            self.changed.notify_all()

    async def follow(self, start: int, keepalive_s: float) -> AsyncIterator[list[dict[str, Any]]]:
        """The events from index `start` on, in batches as they come (what has come since the
        last batch, so a stream can send them in one write), with a keepalive event after each
        quiet `keepalive_s`; ends after the batch with the last one."""
        index = start

        def moved() -> bool:
            return len(self.events) > index or self.ended

        while True:
            quiet = False
            async with self.changed:
                try:
                    await within(self.changed.wait_for(moved), keepalive_s)
                except asyncio.TimeoutError:
                    quiet = True
                batch = self.events[index:]
                done = self.ended
            if quiet and not batch and not done:
                yield [{"keepalive": {}}]
                continue
            index += len(batch)
            if batch:
                yield batch
            if done and index >= len(self.events):
                return


# An ExecCommands call is not reused past this age (a fresh one carries the lease's current
# token), nor kept open idle past it.
MAX_CALL_AGE_S = 60.0
# The node-side deadline of one ExecCommands call; it is replaced long before in practice.
COMMANDS_CALL_S = 2 * UNBOUNDED_COMMAND_S
# The node's deadline for one of the face's own short commands (launch, poll, stdin, kill).
SHORT_COMMAND_S = 30.0
# A client's own timer starts before its request reaches the face, so it can give up on a command
# (TimeoutException) a few milliseconds before the face's deadline for it fires. A command started
# in that window would run beside the timed-out one: processes this close to their deadline are
# killed before a new one is launched.
DEADLINE_SLACK_S = 0.25


@dataclass
class _Op:
    """One short command the lane runs for a process."""

    kind: str  # "launch" | "stdin" | "kill"
    process: Process
    data: bytes = b""
    close: bool = False
    done: asyncio.Future[None] | None = None


class ProcessTable:
    """The E2B processes of one sandbox, by pid. Every process runs detached (see
    `launch_command`); the node only ever runs the face's short commands for them (launch,
    poll, stdin, kill), one after another over one ExecCommands call, so a long or background
    process never holds the sandbox's command queue: later processes start while it runs."""

    def __init__(
        self, target: ExecTarget, *, max_output_bytes: int, max_poll_bytes: int = 4 << 20
    ) -> None:
        self.target = target
        self.max_output_bytes = max_output_bytes
        # What one report reads of each stream: both streams and the header stay under the
        # node's output cap of a command, which would otherwise drop the middle of a large one.
        self.cap = max(1, min(max_poll_bytes, (max_output_bytes - 64) // 2))
        self._trash: list[str] = []  # records of processes ended and read: their files can go
        # Record names are this table's own (a sandbox made from a snapshot of another holds
        # the files the other had then; its pids start over).
        self._records = secrets.token_hex(4)
        self.running: dict[int, Process] = {}
        self._pids = itertools.count(1000)
        self._ops: deque[_Op] = deque()
        self._live: list[Process] = []  # launched, not ended: polled
        self._wake = asyncio.Event()
        self._lane: asyncio.Task[None] | None = None
        self._call: Any = None
        self._opened_at = 0.0
        self._watchdogs: set[asyncio.Task[None]] = set()

    def start(
        self,
        config: ProcessConfig,
        *,
        tag: str | None,
        stdin: bool,
        user: str | None,
        env: Mapping[str, str],
        timeout_s: float | None,
    ) -> Process:
        now = time.monotonic()
        for due in list(self.running.values()):
            if due.deadline is not None and not (due.ended or due.killed):
                if due.deadline - now <= DEADLINE_SLACK_S:
                    due.killed = True
                    self._submit(_Op("kill", due))
        deadline = now + timeout_s if timeout_s else None
        process = Process(next(self._pids), tag, config, deadline, stdin_open=stdin)
        process.start = start_message(
            self.target.sandbox_id,
            launch_command(
                job_spec(config.cmd, config.args, user), self._rec(process), stdin, self.cap
            ),
            cwd=config.cwd or "",
            env={**env, **config.envs},
            timeout_s=SHORT_COMMAND_S,
            max_output_bytes=self.max_output_bytes,
        )
        self.running[process.pid] = process
        self._submit(_Op("launch", process))
        if deadline is not None:
            watchdog = asyncio.get_running_loop().create_task(self._expire(process))
            self._watchdogs.add(watchdog)
            watchdog.add_done_callback(self._watchdogs.discard)
        return process

    def find(self, selector: Mapping[str, Any]) -> Process:
        if "pid" in selector:
            process = self.running.get(int(selector["pid"]))
        elif "tag" in selector:
            process = next((p for p in self.running.values() if p.tag == selector["tag"]), None)
        else:
            raise ConnectError("invalid_argument", "the process selector names no pid or tag")
        if process is None or process.ended:
            raise ConnectError("not_found", f"process {dict(selector)} not found")
        return process

    def _submit(self, op: _Op) -> None:
        self._ops.append(op)
        self._wake.set()
        if self._lane is None or self._lane.done():
            self._lane = asyncio.get_running_loop().create_task(
                self._run_lane(), name=f"e2b.lane.{self.target.sandbox_id}"
            )

    async def _queue(self, op: _Op) -> None:
        """Runs `op` on the lane and waits for it."""
        op.done = asyncio.get_running_loop().create_future()
        self._submit(op)
        await op.done

    def _open_call(self) -> Any:
        now = time.monotonic()
        if self._call is None or now - self._opened_at > MAX_CALL_AGE_S:
            if self._call is not None:
                self._call.cancel()
            self._call = self.target.commands_call(COMMANDS_CALL_S)
            self._opened_at = now
        return self._call

    def _drop_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def _command(
        self, start: pb.ExecStart, stdin: bytes | None = None
    ) -> tuple[bytes, bytes, int]:
        """Runs one short command on the call: its stdout, stderr and exit code."""
        call = self._open_call()
        try:
            await call.write(pb.ExecCommandsRequest(start=start))
            if stdin is not None:
                await call.write(pb.ExecCommandsRequest(stdin=pb.ExecStdin(data=stdin, close=True)))
            out, err = bytearray(), bytearray()

            def take(output: pb.ExecOutput) -> None:
                (out if output.stream == pb.OUTPUT_STREAM_STDOUT else err).extend(output.data)

            while (response := await call.read()) is not grpc.aio.EOF:
                kind = response.WhichOneof("kind")
                if kind == "output":
                    take(response.output)
                elif kind in ("end", "exit"):
                    exit = response.end.exit if kind == "end" else response.exit
                    for chunk in response.end.output if kind == "end" else ():
                        take(chunk)
                    if exit.output_truncated:  # a report is sized to fit; never let it lie
                        raise ConnectError("internal", "a report of the sandbox was truncated")
                    return bytes(out), bytes(err), exit.exit_code
        except BaseException:
            self._drop_call()
            raise
        self._drop_call()
        raise ConnectError("unavailable", "the command's node went away")

    def _short(self, source: str, *, stdin: bool = False) -> pb.ExecStart:
        return start_message(
            self.target.sandbox_id,
            source,
            timeout_s=SHORT_COMMAND_S,
            max_output_bytes=self.max_output_bytes,
            open_stdin=stdin,
        )

    async def _run_lane(self) -> None:
        pause = POLL_MIN_S
        try:
            while True:
                if self._ops:
                    op = self._ops.popleft()
                    try:
                        await self._run_op(op)
                        if op.done is not None and not op.done.done():
                            op.done.set_result(None)
                    except BaseException as exc:
                        if op.done is not None and not op.done.done():
                            op.done.set_exception(
                                exc if isinstance(exc, Exception) else ConnectError("canceled", "")
                            )
                        if not isinstance(exc, Exception):
                            raise
                    pause = POLL_MIN_S
                    continue
                if self._live:
                    moved = False
                    for process in list(self._live):
                        if self._ops:
                            break
                        moved |= await self._guarded(process, self._poll(process))
                    pause = POLL_MIN_S if moved else min(POLL_MAX_S, pause * 2)
                    self._wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await within(self._wake.wait(), pause)
                    continue
                self._wake.clear()
                if self._trash:
                    # Idle with files to remove: remove them unless work comes first.
                    idle = CLEANUP_IDLE_S if len(self._trash) < CLEANUP_MAX else 0.0
                    with contextlib.suppress(asyncio.TimeoutError):
                        await within(self._wake.wait(), idle)
                    if not self._wake.is_set():
                        await self._cleanup()
                    continue
                try:
                    await within(self._wake.wait(), MAX_CALL_AGE_S)
                except asyncio.TimeoutError:
                    self._drop_call()  # idle: leave nothing open on the node
        finally:
            self._drop_call()

    async def _guarded(self, process: Process, step: Any) -> bool:
        """Runs a step for `process`; a node error ends the process with that error."""
        try:
            return bool(await step)
        except grpc.aio.AioRpcError as err:
            await self._fail(process, _exec_error(err))
        except ConnectError as err:
            await self._fail(process, err)
        return True

    async def _fail(self, process: Process, error: ConnectError) -> None:
        self._forget(process)
        await process._emit(None, error)

    def _forget(self, process: Process) -> None:
        if self.running.pop(process.pid, None) is not None:
            self._trash.append(self._rec(process))
        if process in self._live:
            self._live.remove(process)

    async def _run_op(self, op: _Op) -> None:
        process = op.process
        if op.kind == "launch":
            if process.killed:  # killed while waiting its turn: it never runs
                await self._end_killed(process)
                return
            await self._guarded(process, self._launch(process))
        elif op.kind == "stdin":
            if process.ended or process not in self._live:
                return
            start = self._short(stdin_command(self._rec(process), op.close), stdin=True)
            try:
                await self._command(start, op.data)
            except grpc.aio.AioRpcError as err:
                raise _exec_error(err) from None
        elif op.kind == "kill":
            if process.ended:
                return
            if process not in self._live:  # not launched yet: its launch op will see `killed`
                return
            await self._guarded(process, self._kill(process))

    async def _launch(self, process: Process) -> bool:
        out, err, _ = await self._command(process.start)
        await self._report(process, out, err, min(INLINE_READ_BYTES, self.cap))
        if not process.ended:
            self._live.append(process)
        return True

    def _rec(self, process: Process) -> str:
        return f"{self._records}-{process.pid}"

    def _take_trash(self) -> list[str]:
        taken, self._trash = self._trash, []
        return taken

    async def _reported(self, process: Process, source: str, ended: list[str]) -> bool:
        try:
            out, err, _ = await self._command(self._short(source))
        except BaseException:
            self._trash.extend(ended)
            raise
        return await self._report(process, out, err, self.cap)

    async def _poll(self, process: Process) -> bool:
        ended = self._take_trash()
        rec, seen = self._rec(process), (process.out_read, process.err_read)
        free_out, free_err = (
            _to_free(process.out_read, process.out_freed),
            _to_free(process.err_read, process.err_freed),
        )
        source = poll_command(rec, *seen, self.cap, ended, free_out=free_out, free_err=free_err)
        moved = await self._reported(process, source, ended)
        process.out_freed = max(process.out_freed, free_out)
        process.err_freed = max(process.err_freed, free_err)
        return moved

    async def _kill(self, process: Process) -> bool:
        ended = self._take_trash()
        rec, seen = self._rec(process), (process.out_read, process.err_read)
        source = kill_command(rec, *seen, self.cap, ended)
        return await self._reported(process, source, ended)

    async def _cleanup(self) -> None:
        ended = self._take_trash()
        try:
            await self._command(self._short(cleanup_command(ended)))
        except (grpc.aio.AioRpcError, ConnectError):
            pass  # the sandbox is going; its container takes the files with it

    async def _report(self, process: Process, out: bytes, err: bytes, cap: int) -> bool:
        """Emits what a launch/poll/kill command reported; True when anything moved. A report
        that came back full (`cap` bytes of a stream) is followed by another before the
        process's end is told."""
        header, _, data = out.partition(b"\n")
        if data:
            process.out_read += len(data)
            await process._emit({"data": {"stdout": base64.b64encode(data).decode()}})
        if err:
            process.err_read += len(err)
            await process._emit({"data": {"stderr": base64.b64encode(err).decode()}})
        more = len(data) >= cap or len(err) >= cap
        if header == b"K":
            process.kill_sent = True
        if header.startswith(b"E "):
            if not more:
                await self._exited(process, int(header[2:] or b"1"))
        elif header in (b"K", b"R"):
            if process.kill_sent and not more:  # its group is gone and its output read
                await self._end_killed(process)
        elif header == b"G":  # killed inside the sandbox: no status will come
            if not more:
                await self._signaled(process)
        else:
            reason = err.decode(errors="replace").strip() or "no report from the sandbox"
            raise ConnectError("internal", f"process {process.pid} could not be started: {reason}")
        return bool(data or err or process.ended)

    async def _exited(self, process: Process, code: int) -> None:
        self._forget(process)
        if process.killed:
            await self._end_killed(process)
            return
        # envd's end of an exited process (Go's ProcessState and cmd.Wait's error): a non-zero
        # status also comes as the error "exit status N", which the SDK keeps as `.error`.
        status = f"exit status {code}"
        end: dict[str, Any] = {"exitCode": code, "exited": True, "status": status}
        if code:
            end["error"] = status
        await process._emit({"end": end})

    async def _signaled(self, process: Process) -> None:
        """The end of a process whose shell a SIGKILL from inside the sandbox ended (`kill -9
        $$`, a kill of its group): what envd sends for a process killed by a signal (Go's
        ProcessState of it: exit code -1, not exited, status and error `signal: killed`), so the
        SDK raises CommandExitException with exit_code -1 and that error."""
        self._forget(process)
        if process.killed:  # the face's own kill (or timeout) raced it: that end stands
            await self._end_killed(process)
            return
        await process._emit({"end": dict(SIGNAL_KILLED_END)})

    async def _end_killed(self, process: Process) -> None:
        """A killed process's end: E2B's `signal: killed`, or the timeout's error."""
        self._forget(process)
        if process.deadline is not None and process.deadline - time.monotonic() <= DEADLINE_SLACK_S:
            await process._emit(
                None,
                ConnectError(
                    "deadline_exceeded",
                    f"process {process.pid} outlived its timeout and was killed",
                ),
            )
            return
        # envd kills with a signal (SendSignal): the same end as a kill from inside.
        await process._emit({"end": dict(SIGNAL_KILLED_END)})

    async def _expire(self, process: Process) -> None:
        assert process.deadline is not None
        await asyncio.sleep(max(0.0, process.deadline - time.monotonic()))
        if not (process.ended or process.killed):
            await self.signal(process, "SIGNAL_SIGKILL")

    async def signal(self, process: Process, signal: str) -> None:
        """Ends the process and its whole group (SIGTERM and SIGKILL alike); a process still
        waiting its turn is taken out without running."""
        if signal not in ("SIGNAL_SIGKILL", "SIGNAL_SIGTERM"):
            raise ConnectError("invalid_argument", f"unsupported signal {signal!r}")
        process.killed = True
        await self._queue(_Op("kill", process))

    async def send_stdin(self, process: Process, data: bytes, *, close: bool = False) -> None:
        if not process.stdin_open:
            raise ConnectError("failed_precondition", f"process {process.pid} has no open stdin")
        if close:
            process.stdin_open = False
        await self._queue(_Op("stdin", process, data, close))

    async def close(self) -> None:
        """The sandbox is going: its container (and every process in it) goes with it."""
        for op in self._ops:
            if op.done is not None and not op.done.done():
                op.done.set_exception(ConnectError("canceled", "the sandbox was killed"))
        self._ops.clear()
        for watchdog in list(self._watchdogs):
            watchdog.cancel()
        for process in list(self.running.values()):
            self._forget(process)
            await process._emit(None, ConnectError("canceled", "the sandbox was killed"))
        if self._lane is not None:
            self._lane.cancel()
            with contextlib.suppress(BaseException):
                await self._lane


def _to_free(read: int, freed: int) -> int:
    """Up to where an output file is freed now: what was read, once enough more than before."""
    return read if read - freed >= FREE_EVERY_BYTES else 0


def _exec_error(err: grpc.aio.AioRpcError) -> ConnectError:
    code = err.code()
    details = err.details() or code.name
    if code == grpc.StatusCode.NOT_FOUND:
        return ConnectError("not_found", details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ConnectError("failed_precondition", details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ConnectError("invalid_argument", details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ConnectError("unauthenticated", details)
    if code == grpc.StatusCode.CANCELLED:
        return ConnectError("canceled", details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ConnectError("deadline_exceeded", details)
    return ConnectError("unavailable", details)
