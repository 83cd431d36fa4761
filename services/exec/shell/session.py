"""The session of one sandbox (`SandboxShell`): its supervisor, the shell's turn, restarts.

One command at a time holds the shell's turn, callers queued in arrival order. A supervisor that
cannot start because the container stopped (a command killed every process) gets the container
started again, filesystem intact; one that stops too often makes the sandbox lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

import structlog

from swerl.chassis.bounded import within
from swerl.exec.errors import (
    DockerUnavailable,
    InvalidCommand,
    SandboxContainerRemoved,
    SandboxNotRunning,
    SandboxStopped,
    ShellUnavailable,
)
from swerl.exec.outcome import Exit
from swerl.exec.output import STDERR, STDOUT
from swerl.exec.runtime import ContainerNotRunning, ContainerRuntime, ContainerState
from swerl.exec.shell.run import CommandRun
from swerl.exec.shell.spec import CommandSpec, Output
from swerl.exec.shell.supervisor import Supervisor

log = structlog.get_logger(__name__)

# A container that stops this many times within RESTART_WINDOW_S is not started again: something
# kills it as soon as it runs (e.g. out of memory at once), and the sandbox is lost.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
# After Docker refused a shell because the container is stopping, how long to wait for Docker to
# record the stop (it takes milliseconds, up to a second or so on a loaded host), and how often
# to ask.
STOP_SETTLE_S = 10.0
STOP_POLL_S = 0.02
# When a supervisor dies under a command, how long dockerd gets to say whether it stopped the
# container itself (a dockerd that does not answer in time has gone away).
GONE_ASK_S = 2.0
# Docker logs its "kill" event just after the signal is delivered (measured on 20.10: the event
# can be stamped after the container's processes ended), so a supervisor killed by it can be
# seen dead before the event exists. With no kill on record yet, the node watches the container
# this long for the stop Docker's kill brings, then asks again KILL_LOG_GRACE_S after the stop.
KILL_SETTLE_S = 0.5
KILL_LOG_GRACE_S = 0.2


class SandboxShell:
    """The command runner of one sandbox: one supervisor, one command at a time."""

    def __init__(
        self, backend: ContainerRuntime, container_id: str, io_dir: Path, env: Mapping[str, str]
    ) -> None:
        self._backend = backend
        self.container_id = container_id
        self.io_dir = io_dir
        self._env = dict(env)
        # The shell's turn: one command (or the warm-up) at a time, in arrival order. Only
        # take_turn and end_turn touch the lock; `_turn` names its holder.
        self._lock = asyncio.Lock()
        self._turn: object | None = None
        self.supervisor: Supervisor | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        # Set once the container cannot be started again: every later command fails with it.
        self.lost: SandboxNotRunning | SandboxContainerRemoved | None = None
        # The container was started again since the last command: the next Exit says so.
        self._restarted = False
        self._restart_times: collections.deque[float] = collections.deque(maxlen=MAX_RESTARTS)

    async def ensure_supervisor(self) -> Supervisor:
        """The live supervisor, started if there is none. When it cannot start because the
        container stopped (a command killed every process, and docker-init ends with its child),
        the container is started again, filesystem intact, and the next Exit says so; a container
        that cannot be started again makes the sandbox lost (docs/shell-protocol.md, N16)."""
        sup = self.supervisor
        if sup is not None and not sup.dead:
            return sup
        if self.lost is not None:
            raise self.lost
        if sup is not None:
            log.info("shell.restart", container_id=self.container_id[:12])
        try:
            sup = await Supervisor.start(self._backend, self.container_id, self.io_dir, self._env)
        except ShellUnavailable as exc:
            state = await self._settled_state(exc)
            if state is not None and state.running:
                raise
            sup = await self._start_container_again(state)
        self.supervisor = sup
        return sup

    async def stopped_by_docker(self, since: float) -> DockerUnavailable | SandboxStopped | None:
        """Why a supervisor died under a command that started at `since` (wall clock), when the
        command did not do it: Docker stopped the container (a kill it recorded, or dockerd seen
        down since `since`: a stopping or restarting dockerd stops every container, and a
        restarted one has lost its record of the kill), or dockerd no longer answers. None when
        the command (or something inside the container) ended it: its exit status says so."""
        try:
            signal = await within(self._backend.kill_signal(self.container_id, since), GONE_ASK_S)
            if signal is None and await self._stops_within(KILL_SETTLE_S):
                await asyncio.sleep(KILL_LOG_GRACE_S)
                signal = await within(
                    self._backend.kill_signal(self.container_id, since), GONE_ASK_S
                )
        except (DockerUnavailable, asyncio.TimeoutError) as exc:
            why = exc.message if isinstance(exc, DockerUnavailable) else "no answer"
            return DockerUnavailable(
                f"dockerd went away while the command ran ({why}); the command was lost with"
                " the sandbox's container",
                container_id=self.container_id[:12],
            )
        except Exception:  # an answer Docker could not give: nothing known against the command
            return None
        if signal is not None:
            named = f"signal {signal}" if signal >= 0 else "a signal it did not name"
            how = (
                f"Docker stopped the sandbox's container ({named}: `docker stop`, `kill`"
                " or `restart`, or dockerd stopping or restarting)"
            )
        elif self._backend.last_down_wall >= since:
            how = "dockerd went down (stopping or restarting, which stops every container)"
        else:
            return None
        return SandboxStopped(
            f"{how} while the command ran; the command was lost with it, and the next command"
            " starts the container again",
            container_id=self.container_id[:12],
            signal=signal,
        )

    async def _stops_within(self, seconds: float) -> bool:
        """Whether Docker says the container stopped (or is gone) within `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            state = await within(self._backend.container_state(self.container_id), GONE_ASK_S)
            if state is None or not state.running:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(STOP_POLL_S)

    async def _settled_state(self, failure: ShellUnavailable) -> ContainerState | None:
        """Docker's state of the container after a shell did not start. When Docker refused the
        shell's exec because the container is stopping (a command killed every process and
        docker-init has ended, but Docker has not recorded the stop yet and still says running),
        this waits until Docker says it stopped, STOP_SETTLE_S at most: the container is then
        started again, instead of the command failing with the shell's error."""
        state = await self._backend.container_state(self.container_id)
        if not isinstance(failure.__cause__, ContainerNotRunning):
            return state
        deadline = time.monotonic() + STOP_SETTLE_S
        while state is not None and state.running and time.monotonic() < deadline:
            await asyncio.sleep(STOP_POLL_S)
            state = await self._backend.container_state(self.container_id)
        return state

    async def _start_container_again(self, state: ContainerState | None) -> Supervisor:
        short = self.container_id[:12]
        if state is None:
            raise self._lose(
                SandboxContainerRemoved(
                    "the sandbox's container was removed from outside; destroy the sandbox and"
                    " create another",
                    container_id=short,
                )
            )
        now = time.monotonic()
        if (
            len(self._restart_times) == MAX_RESTARTS
            and now - self._restart_times[0] < RESTART_WINDOW_S
        ):
            raise self._lose(
                self._not_running(
                    f"it stopped {MAX_RESTARTS} times within {RESTART_WINDOW_S:g} s"
                    f" ({_how_it_ended(state)})"
                )
            )
        self._restart_times.append(now)
        log.warning("sandbox.restarting", container_id=short, ended=_how_it_ended(state))
        started_wall = time.time()
        refused = await self._backend.start(self.container_id)
        if refused:
            raise await self._docker_or_lost(
                started_wall, self._not_running(f"Docker refuses to start it ({refused})")
            )
        try:
            sup = await Supervisor.start(self._backend, self.container_id, self.io_dir, self._env)
        except ShellUnavailable as exc:
            again = await self._settled_state(exc)
            if again is not None and again.running:
                raise  # the container runs: the shell's own trouble, not the sandbox's
            raise await self._docker_or_lost(
                started_wall,
                self._not_running(f"it stopped again right after a start ({_how_it_ended(again)})"),
            ) from exc
        self._restarted = True
        log.warning("sandbox.restarted", container_id=short)
        return sup

    async def _docker_or_lost(
        self, since: float, lost: SandboxNotRunning
    ) -> DockerUnavailable | SandboxStopped | SandboxNotRunning | SandboxContainerRemoved:
        """Why a container started again at `since` (wall clock) did not come up: Docker's doing
        (`stopped_by_docker`), and the next command starts it again; otherwise the sandbox is
        lost with `lost`."""
        found = await self.stopped_by_docker(since)
        if found is None:
            return self._lose(lost)
        log.warning("sandbox.restart_stopped_by_docker", container_id=self.container_id[:12])
        return found

    def _lose(
        self, error: SandboxNotRunning | SandboxContainerRemoved
    ) -> SandboxNotRunning | SandboxContainerRemoved:
        self.lost = error
        log.warning("sandbox.lost", container_id=self.container_id[:12], reason=error.reason)
        return error

    def take_restarted(self) -> bool:
        """Whether the container was started again since the last command asked (once)."""
        restarted, self._restarted = self._restarted, False
        return restarted

    async def reset(self, sup: Supervisor | None, pgid: int, holder: object) -> None:
        """Puts the shell right after a run the node ended itself, then ends `holder`'s turn:
        what is left of the command and the old supervisor is killed, and the next supervisor
        starts (the container too, when it stopped), so the next command finds one ready."""
        try:
            if sup is not None:
                sup.close()
            await self.kill_inside(pgid=pgid, pids=(sup.pid,) if sup is not None else ())
            if not self.closed:
                with contextlib.suppress(Exception):
                    await self.ensure_supervisor()
        finally:
            self.end_turn(holder)

    async def take_turn(self, holder: object) -> None:
        """Waits until the shell is free (callers queue in arrival order), then gives it to
        `holder` until `holder` calls end_turn."""
        await self._lock.acquire()
        self._turn = holder

    def end_turn(self, holder: object) -> None:
        """Frees the shell for the next in line. A command's turn ends in the reader callback
        that sees its end (docs/shell-protocol.md, "the turn"), not in its caller."""
        if self._turn is not holder:
            raise RuntimeError("the shell's turn ended by a caller that does not hold it")
        self._turn = None
        self._lock.release()

    def busy(self) -> bool:
        """Whether a command holds the shell or waits for it (the warm-up does not count): a
        fork must see the filesystem between commands, never in the middle of one."""
        waiting = getattr(self._lock, "_waiters", None) or ()
        return (self._turn is not None and self._turn is not self) or any(
            not w.cancelled() for w in waiting
        )

    def warm(self) -> None:
        """Starts the shell in the background, so the first command does not pay for it."""

        async def start() -> None:
            await self.take_turn(self)
            try:
                with contextlib.suppress(Exception):
                    await self.ensure_supervisor()
            finally:
                self.end_turn(self)

        self.spawn(start())

    def end_orphan(self) -> None:
        """For a sandbox adopted after a node restart: kills, in the background and before any
        new command runs, the command a node process that died (SIGKILL) was running here. Its
        caller went away with that process, and nothing else would end it (its supervisor waits
        on it, its watchdog only at its timeout). The pgid file names it whether or not it still
        runs (a kill of a group that is gone does nothing)."""

        async def end() -> None:
            await self.take_turn(self)
            try:
                pgid = self.last_pgid()
                if pgid:
                    log.info("shell.orphan_kill", container_id=self.container_id[:12], pgid=pgid)
                    await self.kill_inside(pgid=pgid)
            finally:
                self.end_turn(self)

        self.spawn(end())

    def _not_running(self, why: str) -> SandboxNotRunning:
        return SandboxNotRunning(
            f"the sandbox's container stopped and cannot be started again: {why}; destroy the"
            " sandbox and create another",
            container_id=self.container_id[:12],
        )

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def start(self, spec: CommandSpec) -> CommandRun:
        if not spec.command.strip():
            raise InvalidCommand("empty command")
        return CommandRun(self, spec)

    async def run_capture(
        self, command: str, *, timeout_s: float, max_output_bytes: int
    ) -> tuple[int, bytes, bytes, bool]:
        """Runs a command to completion: (exit_code, stdout, stderr, truncated)."""
        run = self.start(
            CommandSpec(command, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
        )
        out = {STDOUT: bytearray(), STDERR: bytearray()}
        finished = False
        try:
            async for event in run.events():
                if isinstance(event, Output):
                    out[event.stream] += event.data
                elif isinstance(event, Exit):
                    finished = True
                    return (
                        event.exit_code,
                        bytes(out[STDOUT]),
                        bytes(out[STDERR]),
                        event.output_truncated,
                    )
        finally:
            if not finished:
                run.abandon()
        raise ShellUnavailable("command ended without an exit status")

    def timed_out_pgid(self) -> int:
        """The process group the watchdog last killed at its deadline (0 if none is left)."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.io_dir / "timeout").read_text().split()[0])
        return 0

    def last_pgid(self) -> int:
        """The process group of the last command any supervisor of this sandbox started (0 if
        none, or the record is half-written)."""
        with contextlib.suppress(OSError, ValueError):
            fields = (self.io_dir / "pgid").read_text().split()
            if len(fields) == 4 and fields[0] == fields[3]:
                return int(fields[1])
        return 0

    def current_pgid(self, nonce: str) -> int:
        """The process group of the command with this nonce, once it has been forked."""
        with contextlib.suppress(OSError, ValueError):
            # "<nonce> <pgid> <deadline_us> <nonce>", overwritten in place (see supervisor.sh)
            fields = (self.io_dir / "pgid").read_text().split()
            if len(fields) == 4 and fields[0] == nonce and fields[3] == nonce:
                return int(fields[1])
        return 0

    async def kill_group(self, pgid: int, signal: str = "KILL") -> None:
        """Signals a command's process group from a side `docker exec` (~60 ms, rare)."""
        with contextlib.suppress(Exception):
            await self._backend.exec_run(
                self.container_id, ["bash", "-c", f"kill -s {signal} -- -{int(pgid)}"]
            )

    async def kill_inside(
        self, *, pgid: int = 0, pids: tuple[int, ...] = (), cont: tuple[int, ...] = ()
    ) -> None:
        """One side `docker exec` that continues `cont` (stopped by a command), then kills the
        process group `pgid` and the processes `pids`; a container that stopped meanwhile has
        nothing left to kill."""
        script = "".join(
            [
                *(f"kill -s CONT {int(pid)}; " for pid in cont if pid),
                f"kill -s KILL -- -{int(pgid)}; " if pgid else "",
                *(f"kill -s KILL {int(pid)}; " for pid in pids if pid),
            ]
        )
        if script:
            with contextlib.suppress(Exception):
                await self._backend.exec_run(self.container_id, ["bash", "-c", script + "exit 0"])

    async def close(self) -> None:
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        if self.supervisor is not None:
            self.supervisor.close()


def _how_it_ended(state: ContainerState | None) -> str:
    if state is None:
        return "removed"
    how = f"exit code {state.exit_code}"
    if state.oom_killed:
        how += ", out of memory"
    if state.error:
        how += f", {state.error}"
    return how
