"""E2B processes of one sandbox, run one after another over one ExecCommands call.

A process gets its pid from the face at once (so `commands.run(..., background=True)` returns
before the node runs it); its output, its end and its errors are kept as E2B process events that
the Start stream and any later Connect stream follow. stdin and signals go down the call.

The command runs as E2B runs it, `/bin/bash -c CMD`, as a job of its own (see `shell_command`),
so that what it leaves running with `&` or nohup outlives it as it would on E2B; the node's
shell traps SIGTERM to kill the job's group, which is how a kill or a timeout ends all of it.
Commands on one sandbox run one at a time on swerl's nodes: a background command holds the
sandbox's command queue until it ends (detach with `&` for concurrency, see docs/e2b.md).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import shlex
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from swerl.e2b.connect import ConnectError
from swerl.exec.client import start_message
from swerl.exec.v1 import sandbox_pb2 as pb

# The backstop past a command's own deadline before the node kills it by itself.
NODE_TIMEOUT_MARGIN_S = 5.0
# A command with no deadline (timeout=0) still has one on the node.
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


# Where a running process's group id is kept in the sandbox, for a kill that must reach it.
RECORD_PREFIX = "/tmp/.swerl-e2b-"


def _job(config: ProcessConfig, user: str | None) -> str:
    """The bash source of the job itself.

    E2B runs `/bin/bash -l -c CMD`. The node's shell is a login shell already, with the
    profile's environment, so as root CMD runs in a subshell of it (`eval` keeps a syntax error
    of CMD inside the job): no exec, no profile read per command, which are most of a short
    command's cost. Any other process, or another user, runs as its own argv.
    """
    argv = [config.cmd, *config.args]
    if not (user and user != "root") and len(argv) == 4 and argv[:3] == ["/bin/bash", "-l", "-c"]:
        return f"eval {shlex.quote(argv[3])}"
    if argv[:2] == ["/bin/bash", "-l"]:
        argv = ["/bin/bash", *argv[2:]]
    if user and user != "root":
        argv = ["runuser", "-u", user, "--", *argv]
    return shlex.join(argv)


def shell_command(config: ProcessConfig, user: str | None, pid: int) -> str:
    """The bash source the node runs for an E2B process.

    The process runs as a job of its own (`set -m` gives it its own process group), so what it
    leaves running with `&` or nohup is not in the node's command group and outlives it, as on
    E2B. SIGTERM (a kill, or the face's deadline) makes the waiting shell kill that group; the
    record lets a later command kill it when the node killed the shell itself (its backstop).
    Only builtins run around the job: no fork is added to a short command's path.
    """
    return (
        f"set -m; {_job(config, user)} <&0 & __e2b_pid=$!; set +m; "
        f"echo $__e2b_pid >{RECORD_PREFIX}{pid}; "
        "trap 'kill -KILL -- -$__e2b_pid 2>/dev/null' TERM; "
        "wait $__e2b_pid; __e2b_rc=$?; "
        'if [ "$__e2b_rc" -gt 128 ]; then wait $__e2b_pid; __e2b_w=$?; '
        '[ "$__e2b_w" -ne 127 ] && __e2b_rc=$__e2b_w; fi; '
        "__e2b_status() { return $1; }; __e2b_status $__e2b_rc"
    )


def kill_group_command(pid: int) -> str:
    """Kills what is left of a process whose waiting shell the node killed (its timeout)."""
    record = f"{RECORD_PREFIX}{pid}"
    return f"[ -s {record} ] && kill -KILL -- -$(cat {record}) 2>/dev/null; rm -f {record}; true"


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
    call: Any = None
    stdin_open: bool = False
    killed: bool = False
    start: Any = None  # the ExecStart the lane sends when the process's turn comes
    pending_stdin: list[tuple[bytes, bool]] = field(default_factory=list)

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

    async def follow(self, start: int, keepalive_s: float) -> AsyncIterator[dict[str, Any]]:
        """The events from index `start` on, as they come, with a keepalive event after each
        quiet `keepalive_s`; ends after the last one."""
        index = start

        def moved() -> bool:
            return len(self.events) > index or self.ended

        while True:
            quiet = False
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait_for(moved), timeout=keepalive_s)
                except asyncio.TimeoutError:
                    quiet = True
                batch = self.events[index:]
                done = self.ended
            if quiet and not batch and not done:
                yield {"keepalive": {}}
                continue
            index += len(batch)
            for event in batch:
                yield event
            if done and index >= len(self.events):
                return


# An ExecCommands call is not reused past this age (a fresh one carries the lease's current
# token), nor kept open idle past it.
MAX_CALL_AGE_S = 60.0
# The node-side deadline of one ExecCommands call; it is replaced long before in practice.
COMMANDS_CALL_S = 2 * UNBOUNDED_COMMAND_S


class ProcessTable:
    """The E2B processes of one sandbox, by pid, run one after another over one ExecCommands
    call (the node runs a sandbox's commands one at a time anyway; one call saves the cost of a
    call per command). Only the running process has been sent to the node, so a signal or stdin
    on the call always reaches the process it is meant for, and a kill of a process still
    waiting its turn just takes it out of the queue."""

    def __init__(self, target: ExecTarget, *, max_output_bytes: int) -> None:
        self.target = target
        self.max_output_bytes = max_output_bytes
        self.running: dict[int, Process] = {}
        self._pids = itertools.count(1000)
        self._queue: deque[Process] = deque()
        self._wake = asyncio.Event()
        self._lane: asyncio.Task[None] | None = None
        self._call: Any = None
        self._opened_at = 0.0
        self.current: Process | None = None

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
        deadline = time.monotonic() + timeout_s if timeout_s else None
        process = Process(next(self._pids), tag, config, deadline, stdin_open=stdin)
        node_timeout = (timeout_s + NODE_TIMEOUT_MARGIN_S) if timeout_s else UNBOUNDED_COMMAND_S
        process.start = start_message(
            self.target.sandbox_id,
            shell_command(config, user, process.pid),
            cwd=config.cwd or "",
            env={**env, **config.envs},
            timeout_s=node_timeout,
            max_output_bytes=self.max_output_bytes,
            open_stdin=stdin,
        )
        self.running[process.pid] = process
        self._queue.append(process)
        self._wake.set()
        if self._lane is None or self._lane.done():
            self._lane = asyncio.get_running_loop().create_task(
                self._run_lane(), name=f"e2b.lane.{self.target.sandbox_id}"
            )
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

    async def _run_lane(self) -> None:
        try:
            while True:
                if not self._queue:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), MAX_CALL_AGE_S)
                    except asyncio.TimeoutError:
                        self._drop_call()  # idle: leave nothing open on the node
                    continue
                process = self._queue.popleft()
                self.current = process
                try:
                    await self._run(process)
                finally:
                    self.current = None
                    self.running.pop(process.pid, None)
        finally:
            self._drop_call()

    async def _run(self, process: Process) -> None:
        watchdog = None
        try:
            call = self._open_call()
            await call.write(pb.ExecCommandsRequest(start=process.start))
            process.call = call
            for data, close in process.pending_stdin:
                await call.write(pb.ExecCommandsRequest(stdin=pb.ExecStdin(data=data, close=close)))
            process.pending_stdin.clear()
            if process.killed:
                await call.write(
                    pb.ExecCommandsRequest(signal=pb.ExecSignal(signal=pb.SIGNAL_TERM))
                )
            if process.deadline is not None:
                watchdog = asyncio.get_running_loop().create_task(self._expire(process))
            await self._pump(process, call)
        except grpc.aio.AioRpcError as err:
            self._drop_call()
            await process._emit(None, _exec_error(err))
        except asyncio.CancelledError:
            self._drop_call()
            await process._emit(None, ConnectError("canceled", "the sandbox was killed"))
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()

    async def _pump(self, process: Process, call: Any) -> None:
        while (response := await call.read()) is not grpc.aio.EOF:
            kind = response.WhichOneof("kind")
            if kind == "output":
                await self._output(process, response.output)
            elif kind == "end":
                for chunk in response.end.output:
                    await self._output(process, chunk)
                await self._exited(process, response.end.exit)
                return
            elif kind == "exit":
                await self._exited(process, response.exit)
                return
        self._drop_call()
        await process._emit(None, ConnectError("unavailable", "the command's node went away"))

    @staticmethod
    async def _output(process: Process, output: pb.ExecOutput) -> None:
        name = "stdout" if output.stream == pb.OUTPUT_STREAM_STDOUT else "stderr"
        await process._emit({"data": {name: base64.b64encode(output.data).decode()}})

    async def _exited(self, process: Process, exit: pb.ExecExit) -> None:
        """Emits the process's end, once a kill or a timeout has reached its whole group."""
        expired = process.deadline is not None and time.monotonic() >= process.deadline
        if exit.timed_out:
            # The node's own backstop killed the shell with SIGKILL, which its trap cannot
            # catch: the group is killed by a command of its own.
            await self._kill_group(process)
        if exit.timed_out or expired:
            await process._emit(
                None,
                ConnectError(
                    "deadline_exceeded",
                    f"process {process.pid} outlived its timeout and was killed",
                ),
            )
            return
        code = exit.exit_code
        end: dict[str, Any] = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
        if code > 128 and (exit.signaled or process.killed):
            end["status"] = "signal: killed"
        await process._emit({"end": end})

    async def _expire(self, process: Process) -> None:
        assert process.deadline is not None
        await asyncio.sleep(max(0.0, process.deadline - time.monotonic()))
        await self.signal(process, "SIGNAL_SIGKILL")

    async def signal(self, process: Process, signal: str) -> None:
        """Ends the process and its whole group (SIGTERM and SIGKILL alike); a process still
        waiting its turn leaves the queue without running."""
        if signal not in ("SIGNAL_SIGKILL", "SIGNAL_SIGTERM"):
            raise ConnectError("invalid_argument", f"unsupported signal {signal!r}")
        process.killed = True
        if process in self._queue:
            self._queue.remove(process)
            self.running.pop(process.pid, None)
            end = {"exitCode": 137, "exited": True, "status": "signal: killed"}
            await process._emit({"end": end})
            return
        if process is self.current and process.call is not None and not process.ended:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await process.call.write(
                    pb.ExecCommandsRequest(signal=pb.ExecSignal(signal=pb.SIGNAL_TERM))
                )

    async def _kill_group(self, process: Process) -> None:
        call = self.target.exec_call(30.0)
        try:
            start = start_message(
                self.target.sandbox_id, kill_group_command(process.pid), timeout_s=10.0
            )
            await call.write(pb.ExecRequest(start=start))
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError:
            pass
        finally:
            call.cancel()

    async def send_stdin(self, process: Process, data: bytes, *, close: bool = False) -> None:
        if not process.stdin_open:
            raise ConnectError("failed_precondition", f"process {process.pid} has no open stdin")
        if close:
            process.stdin_open = False
        if process is self.current and process.call is not None:
            await process.call.write(
                pb.ExecCommandsRequest(stdin=pb.ExecStdin(data=data, close=close))
            )
        else:
            process.pending_stdin.append((data, close))

    async def close(self) -> None:
        for process in list(self._queue):
            self._queue.clear()
            await process._emit(None, ConnectError("canceled", "the sandbox was killed"))
        if self._lane is not None:
            self._lane.cancel()
            with contextlib.suppress(BaseException):
                await self._lane


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
