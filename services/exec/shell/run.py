"""One command's run (`CommandRun`): written to the supervisor, its events read back.

A run needs a few things of the session it runs in (its turn, its supervisor, the process group
files of its I/O dir, kills from outside); `RunShell` names exactly those, so this module does
not depend on the session's class (swerl.exec.shell.session builds runs, not the other way round).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import secrets
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, Protocol

import structlog

from swerl.chassis.bounded import within
from swerl.exec.errors import CwdNotFound
from swerl.exec.outcome import Exit
from swerl.exec.output import OutputCap
from swerl.exec.shell.spec import CommandSpec, Event, Output, Started
from swerl.exec.shell.supervisor import Supervisor
from swerl.exec.shell.wire import (
    CONTAINER_IO_DIR,
    MAX_TIMEOUT_S,
    bash_quote,
    env_script,
    frame,
    make_fifo,
    open_fifo_end,
    unblock_fifo,
)

log = structlog.get_logger(__name__)

# Seconds the node waits past a command's own timeout before it steps in from outside (N13): the
# in-container watchdog fires on time unless a command stopped or killed it (or the supervisor).
BACKSTOP_GRACE_S = 0.5
# After stepping in, how long the node waits for the command's end before it ends the call
# itself: the backstop and this together stay under the promised timeout + 1 s.
GIVE_UP_S = 0.4
# After a cancelled caller's command was killed, how long to wait for the supervisor to report
# before replacing it (nobody waits on the call; the next command does).
RESYNC_S = 2.0
# Output events queued for a slow caller before the FIFOs stop being read (backpressure).
PAUSE_AT, RESUME_AT = 64, 8


class RunShell(Protocol):
    """What a run needs of the session it runs in (SandboxShell is one)."""

    @property
    def container_id(self) -> str: ...

    @property
    def io_dir(self) -> Path: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...

    async def take_turn(self, holder: object) -> None: ...

    def end_turn(self, holder: object) -> None: ...

    async def ensure_supervisor(self) -> Supervisor: ...

    async def stopped_by_docker(self, since: float) -> Exception | None: ...

    def take_restarted(self) -> bool: ...

    def current_pgid(self, nonce: str) -> int: ...

    def timed_out_pgid(self) -> int: ...

    async def kill_group(self, pgid: int, signal: str = "KILL") -> None: ...

    async def kill_inside(
        self, *, pgid: int = 0, pids: tuple[int, ...] = (), cont: tuple[int, ...] = ()
    ) -> None: ...

    async def reset(self, sup: Supervisor | None, pgid: int, holder: object) -> None: ...


_DONE = object()


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


# Command nonces: unique within this node process, and across restarts thanks to the prefix (a
# pgid file left by an earlier node must never match a new command).
_NONCE_PREFIX = secrets.token_hex(4)
_nonces = itertools.count(1)
# CommandRun states.
_NEW, _RUNNING, _FINISHED = 0, 1, 2


class CommandRun:
    """One command: `events()` yields [Started], Output..., then exactly one Exit.

    No task of its own: the caller iterating `events()` takes the shell's turn, writes the
    command and reads events the FIFO readers put here. The turn ends in the reader callback
    that sees the command's end marker, so the next command can start without another trip
    through the event loop. A caller that goes away calls `abandon()`: the command's process
    group is killed, and the turn stays held until the supervisor reports (or is replaced), so
    the next command always finds it in step (docs/shell-protocol.md, N1-N15 and "the turn").
    """

    def __init__(self, shell: RunShell, spec: CommandSpec) -> None:
        self._shell = shell
        self.spec = spec
        self.nonce = f"{_NONCE_PREFIX}{next(_nonces):x}"
        # The id of this command's early end marker W (see supervisor.sh): one-time, unguessable.
        self._end_id = secrets.token_hex(8)
        self._items: collections.deque[object] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._sup: Supervisor | None = None
        self._state = _NEW
        self._abandoned = False
        self._signaled = False
        self._timed_out = False
        self._backstop_fired = False
        self._cwd_missing = False
        self._backstop: asyncio.TimerHandle | None = None
        self._give_up: asyncio.TimerHandle | None = None
        self._restarted = False
        self._exit_code: int | None = None
        self._cap = OutputCap(max(spec.max_output_bytes, 2))
        self._started_at = 0.0
        self._started_wall = 0.0
        self._finished_waiters: list[asyncio.Future[None]] = []
        self._stdin_fifo = shell.io_dir / f"stdin.{self.nonce}" if spec.open_stdin else None
        self._stdin_fd: int | None = None
        self._stdin_ready: asyncio.Event | None = asyncio.Event() if spec.open_stdin else None
        self._opening: asyncio.Future[int] | None = None
        # Set when the run ended with the stdin FIFO's open still pending: its done callback
        # then closes what the open returns, and nothing else may.
        self._opening_orphaned = False
        # Built (and validated) now, so a bad command fails before it waits for the shell.
        stdin_path = f"{CONTAINER_IO_DIR}/{self._stdin_fifo.name}" if self._stdin_fifo else ""
        self._line = frame(
            b" ".join(
                [
                    self.nonce.encode(),
                    b"%012.3f" % min(max(spec.timeout_s, 0.001), MAX_TIMEOUT_S),
                    b"s" if spec.session else b"i",
                    b"1" if spec.notify_started or spec.open_stdin else b"0",
                    self._end_id.encode(),
                    bash_quote(spec.cwd) if spec.cwd else b"''",
                    bash_quote(stdin_path) if stdin_path else b"''",
                    bash_quote(env_script(spec.env)) if spec.env else b"''",
                    bash_quote(spec.command),
                ]
            )
        )

    @property
    def finished(self) -> bool:
        return self._state == _FINISHED

    # -- consumer side --------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        if self._state == _NEW and not self._abandoned:
            await self._begin()
        items = self._items
        while True:
            if not items:
                if self._state != _RUNNING:
                    return
                waiter = self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
                continue
            item = items.popleft()
            sup = self._sup
            if sup is not None and sup.paused and len(items) <= RESUME_AT:
                sup.resume()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
            if isinstance(item, Exit):
                return

    def abandon(self) -> None:
        """The caller is gone: kill the command; the supervisor re-synchronises on its own."""
        if self._state == _FINISHED or self._abandoned:
            return
        self._abandoned = True
        self._items.clear()
        if self._state == _NEW:  # never written: nothing runs
            return
        if self._sup is not None:
            self._sup.resume()
        self._shell.spawn(self._kill("KILL"))
        self._shell.spawn(self._replace_if_stuck())

    def request_signal(self, signal: str) -> None:
        if self._state == _FINISHED:
            return
        self._signaled = True
        self._shell.spawn(self._kill(signal))

    @property
    def events_waiting(self) -> int:
        """Events queued for the caller and not taken yet."""
        return len(self._items)

    async def settle(self, timeout_s: float) -> None:
        """Waits until the command has finished, or `timeout_s` at most."""
        if self._state == _FINISHED:
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._finished_waiters.append(waiter)
        timer = loop.call_later(timeout_s, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            with contextlib.suppress(ValueError):
                self._finished_waiters.remove(waiter)

    async def wait_finished(self) -> None:
        if self._state != _FINISHED:
            waiter = asyncio.get_running_loop().create_future()
            self._finished_waiters.append(waiter)
            await waiter

    async def _kill(self, signal: str) -> None:
        # The command may not be forked yet: its pgid appears in the I/O dir within a moment.
        deadline = time.monotonic() + 5.0
        while self._state != _FINISHED and time.monotonic() < deadline:
            pgid = self._shell.current_pgid(self.nonce)
            if pgid:
                await self._shell.kill_group(pgid, signal)
                return
            await asyncio.sleep(0.005)

    async def _replace_if_stuck(self) -> None:
        # The kill should bring the end marker within milliseconds; if not, the supervisor is
        # wedged and the next command must get a fresh one.
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await within(self.wait_finished(), RESYNC_S)
            return
        if self._state == _RUNNING:
            self._end_now(timed_out=False)

    async def write_stdin(self, data: bytes, close: bool) -> None:
        if self._stdin_ready is None:
            return
        await self._stdin_ready.wait()
        fd = self._stdin_fd
        if fd is None:
            return
        view = memoryview(data)
        while view:
            try:
                view = view[await asyncio.to_thread(os.write, fd, view) :]
            except OSError:  # the command closed its stdin or ended
                return
        if close:
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self._stdin_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._stdin_fd)
            self._stdin_fd = None

    # -- reader callbacks -----------------------------------------------------------------
    def _put(self, item: object) -> None:
        if self._abandoned:
            return
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if len(self._items) >= PAUSE_AT and self._sup is not None:
            self._sup.pause()

    def _on_marker(self, payload: bytes) -> None:
        sup = self._sup
        assert sup is not None
        kind = payload[:2]
        if kind == b"W:" and sup.gone():
            # The command ended on its own just as the supervisor died: it killed the
            # supervisor (or every process), so it is reported as N10 says, not by its W.
            self._on_eof()
        elif kind in (b"E:", b"W:"):
            self._exit_code = int(payload[2:])
            sup.drain_stderr()
            if kind == b"W:":
                sup.ended_early()
            self._finish(self._exit_code)
        elif payload == b"T":
            self._timed_out = True
        elif payload == b"D":
            self._cwd_missing = True
        elif kind == b"S:":
            self._put(Started(int(payload[2:])))

    def _on_output(self, stream: int, data: bytes) -> None:
        for out_stream, chunk in self._cap.feed(stream, data):
            self._put(Output(out_stream, chunk))

    def _on_eof(self) -> None:
        """The supervisor died under the command (`kill -9 $$`, or every process killed): N10."""
        if self._state != _RUNNING or self._exit_code is not None:
            return
        sup = self._sup
        if sup is not None and sup.dead and sup.dropped_held:
            # It died before this command's line left the node (the command before ended by W
            # as it killed the supervisor): nothing ran, so the command runs on the next one.
            sup.sink = sup.on_marker = sup.on_eof = None
            self._shell.spawn(self._start_over())
            return
        pgid = self._shell.current_pgid(self.nonce)
        # The watchdog leaves the pgid it killed at the deadline in the timeout file.
        timed_out = bool(pgid) and self._shell.timed_out_pgid() == pgid
        if timed_out or self._backstop_fired:
            # Past its deadline: it timed out, whatever else happened; nothing to ask Docker.
            self._end_now(timed_out=True)
        else:
            self._shell.spawn(self._end_after_asking(timed_out))

    async def _end_after_asking(self, timed_out: bool) -> None:
        """Ends the run whose supervisor died: with 137 when the command (or anything inside the
        container) did it, with the node's reason when Docker stopped the container or dockerd
        went away (a dockerd stopping or restarting stops every container): then the command
        did not end, it was lost with its container, and its caller is told so, not handed an
        exit code."""
        cause = await self._shell.stopped_by_docker(self._started_wall)
        if self._state != _RUNNING or self._exit_code is not None:
            return  # the backstop ended it meanwhile
        if cause is None:
            self._end_now(timed_out=timed_out)
        else:
            self._end_now(timed_out=False, failure=cause)

    def _end_now(self, *, timed_out: bool, failure: Exception | None = None) -> None:
        """Ends the run at once with 137 (killed), or with `failure` as its last event, without
        waiting for anything in the container; the turn stays held until the shell is put
        right (SandboxShell.reset)."""
        sup = self._sup
        pgid = self._shell.current_pgid(self.nonce)
        if sup is not None:
            sup.sink = sup.on_marker = sup.on_eof = None
            sup.close()
        self._exit_code = 137
        self._timed_out = self._timed_out or timed_out
        if failure is None:
            self._finish(137, keep_turn=True)
        elif self._state == _RUNNING:
            self._put(failure)
            self._release(keep_turn=True)
        self._shell.spawn(self._shell.reset(sup, pgid, self))

    def _finish(self, exit_code: int, *, keep_turn: bool = False) -> None:
        """The command has ended: hand over its exit, then free the shell for the next one
        (unless `keep_turn`: then whoever puts the shell right ends the turn)."""
        if self._state != _RUNNING:
            return
        for out_stream, chunk in self._cap.finish():
            self._put(Output(out_stream, chunk))
        if self._cwd_missing:
            # The command never ran: the call fails with the reason, not an exit status.
            self._put(
                CwdNotFound(
                    f"cwd {self.spec.cwd!r} is not a directory the command can enter",
                    cwd=self.spec.cwd,
                )
            )
            self._release(keep_turn)
            return
        # Past its timeout and the backstop's grace, a command that ended did so because the
        # node stepped in: it timed out, whoever delivered the kill.
        timed_out = self._timed_out or self._backstop_fired
        self._put(
            Exit(
                exit_code=exit_code,
                timed_out=timed_out,
                output_truncated=self._cap.truncated,
                bytes_dropped=self._cap.dropped,
                duration_s=time.monotonic() - self._started_at,
                signaled=self._signaled and not timed_out,
                sandbox_restarted=self._restarted,
            )
        )
        self._release(keep_turn)

    def _release(self, keep_turn: bool = False) -> None:
        self._state = _FINISHED
        sup = self._sup
        if sup is not None and sup.sink == self._on_output:
            sup.sink = sup.on_marker = sup.on_eof = None
            sup.scanner.end_id = b""
        for timer in (self._backstop, self._give_up):
            if timer is not None:
                timer.cancel()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        for waiter in self._finished_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._finished_waiters.clear()
        if self._stdin_ready is not None:
            self._stdin_ready.set()
            self._close_stdin()
            self._drop_stdin_fifo()
        if not keep_turn:
            self._shell.end_turn(self)

    def _drop_stdin_fifo(self) -> None:
        opening = self._opening
        if opening is not None and not opening.done() and self._stdin_fifo is not None:
            # A thread still blocked opening the stdin FIFO returns once a reader shows up.
            unblock_fifo(self._stdin_fifo)
            opening.add_done_callback(_close_opened)  # the one owner of what it opens now
            self._opening_orphaned = True
        if self._stdin_fifo is not None:
            with contextlib.suppress(OSError):
                self._stdin_fifo.unlink()

    # -- start ----------------------------------------------------------------------------
    async def _begin(self) -> None:
        shell, spec = self._shell, self.spec
        await shell.take_turn(self)
        try:
            sup = await shell.ensure_supervisor()
            if self._stdin_fifo is not None:
                make_fifo(self._stdin_fifo)
        except BaseException as exc:
            shell.end_turn(self)
            self._state = _FINISHED
            if self._stdin_ready is not None:
                self._stdin_ready.set()
            if not isinstance(exc, Exception):
                raise
            self._items.append(exc)
            return
        self._state = _RUNNING
        self._started_at = time.monotonic()
        self._started_wall = time.time()
        loop = asyncio.get_running_loop()
        self._backstop = loop.call_later(spec.timeout_s + BACKSTOP_GRACE_S, self._backstop_fire)
        if self._stdin_fifo is not None:
            self._opening = open_fifo_end(self._stdin_fifo, os.O_WRONLY)
            shell.spawn(self._await_stdin(self._opening))
        self._send_to(sup)

    def _send_to(self, sup: Supervisor) -> None:
        self._sup = sup
        self._restarted = self._shell.take_restarted()
        sup.sink, sup.on_marker, sup.on_eof = self._on_output, self._on_marker, self._on_eof
        sup.scanner.end_id = self._end_id.encode()
        sup.send(self._line)

    async def _start_over(self) -> None:
        """The line never reached the supervisor that died: send it to the next one (started
        now, and the container with it when it stopped), still holding the turn."""
        try:
            sup = await self._shell.ensure_supervisor()
        except Exception as exc:
            if self._state == _RUNNING:  # as N2: the error is the run's last event
                self._put(exc)
                self._release()
            return
        if self._state == _RUNNING:
            self._send_to(sup)

    async def _await_stdin(self, opening: asyncio.Future[int]) -> None:
        assert self._stdin_ready is not None
        finished = asyncio.ensure_future(self.wait_finished())
        try:
            either: set[asyncio.Future[Any]] = {opening, finished}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()
        if opening.done() and not opening.cancelled() and opening.exception() is None:
            if self._opening_orphaned:
                pass  # _close_opened closes it: a second close could hit a reused descriptor
            elif self._state == _FINISHED:
                os.close(opening.result())
            else:
                self._stdin_fd = opening.result()
        self._stdin_ready.set()

    def _backstop_fire(self) -> None:
        """N13: the command outlived its timeout by BACKSTOP_GRACE_S, so the watchdog did not end
        it (a command stopped or killed it, or stopped the supervisor). The node continues the
        supervisor and kills the group from outside; if the end still has not come GIVE_UP_S
        later, the node ends the call itself and replaces the supervisor."""
        self._backstop_fired = True
        sup = self._sup
        log.warning("exec.backstop", container_id=self._shell.container_id[:12])
        self._shell.spawn(
            self._shell.kill_inside(
                pgid=self._shell.current_pgid(self.nonce),
                cont=(sup.pid,) if sup is not None else (),
            )
        )
        self._give_up = asyncio.get_running_loop().call_later(GIVE_UP_S, self._give_up_fire)

    def _give_up_fire(self) -> None:
        if self._state == _RUNNING:
            log.warning("exec.backstop_gave_up", container_id=self._shell.container_id[:12])
            self._end_now(timed_out=True)


def _close_opened(opening: asyncio.Future[int]) -> None:
    """Closes the descriptor an abandoned open produced, if it produced one."""
    if not opening.cancelled() and opening.exception() is None:
        os.close(opening.result())
