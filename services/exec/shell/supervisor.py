"""The supervisor: one `bash --login -s` in the container, fed supervisor.sh, on FIFOs.

Its stdin, stdout and stderr are FIFOs of the sandbox's I/O directory; a fourth (`life`) only the
supervisor holds open, so its end of file says the supervisor is gone. The node reads stdout and
stderr from event-loop callbacks and hands output, markers and the end to whichever run holds the
shell (`sink`, `on_marker`, `on_eof`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from swerl.exec.errors import ShellUnavailable
from swerl.exec.output import STDERR, STDOUT
from swerl.exec.runtime import ContainerNotRunning, ContainerRuntime
from swerl.exec.shell.wire import (
    CONTAINER_IO_DIR,
    MarkerScanner,
    env_script,
    make_fifo,
    open_fifo_end,
)

log = structlog.get_logger(__name__)

SUPERVISOR_SCRIPT = (Path(__file__).with_name("supervisor.sh")).read_bytes()
READY_TIMEOUT_S = 60.0
# While a shell starts, how often the node asks Docker whether its process still runs: a
# container that dies before the shell has opened its FIFOs leaves the node's opens waiting for
# a peer that will never come, and only Docker can tell.
START_POLL_S = 0.25
READ_CHUNK = 256 * 1024
# FIFOs of a supervisor besides its stdio: the watchdog's and the workers' batons.
_SIDE_FIFOS = ("ctl", "baton0", "baton1")
_generation = itertools.count(1)
# How long an open that was given a peer may take to return before it is given up.
CLOSE_OPENS_WAIT_S = 5.0


async def _close_opens(opens: Mapping[str, asyncio.Future[int]], names: Mapping[str, Path]) -> None:
    """Ends the FIFO opens of a shell that will not start and closes what they opened.

    Each FIFO still being opened gets a peer held open (O_RDWR) until its open has returned:
    an open whose thread has not called os.open yet does so only later, and a peer opened and
    closed at once before that left it blocked for good (and the FIFO's name is removed with
    the sandbox's I/O dir, so nothing could open it again). Such a thread is a daemon of its
    own (`open_fifo_end`), so even then it holds up no executor and no shutdown.

    An open no peer can meet (its FIFO's name is gone: the sandbox was destroyed while its
    shell started) is not waited for, nor one still blocked after CLOSE_OPENS_WAIT_S (its name
    now names a later shell's FIFO): its future is cancelled, and the thread closes whatever
    it may still get. Waiting for it hung the process's shutdown for good."""
    peers: list[int] = []
    waiting: list[asyncio.Future[int]] = []
    try:
        for key, task in opens.items():
            if task.done():
                continue
            try:
                peers.append(os.open(names[key], os.O_RDWR | os.O_NONBLOCK))
            except OSError:
                task.cancel()
                continue
            waiting.append(task)
        if waiting:
            _, stuck = await asyncio.wait(waiting, timeout=CLOSE_OPENS_WAIT_S)
            for task in stuck:
                task.cancel()
    finally:
        for fd in peers:
            os.close(fd)
        for task in opens.values():
            if task.done() and not task.cancelled() and task.exception() is None:
                os.close(task.result())


async def _watch_start(backend: ContainerRuntime, container_id: str, exec_id: str) -> None:
    """Returns only by raising: once the starting shell's process has ended, ContainerNotRunning
    when its container stopped with it (the shell is started again with the container), else
    EOFError (the shell itself gave up)."""
    while True:
        await asyncio.sleep(START_POLL_S)
        if await backend.exec_running(exec_id):
            continue
        if await backend.is_running(container_id):
            raise EOFError("the shell exited while it started")
        raise ContainerNotRunning("the container stopped while its shell started")


async def _unless_ended(work: Awaitable[Any], watch: asyncio.Future[None], what: str) -> Any:
    """`work`'s result, unless the shell's process ended first (`watch` raises why) or
    READY_TIMEOUT_S passed. A `work` that loses is cancelled: for the FIFO opens that is an
    `asyncio.wait` over them, whose cancel leaves the opens themselves running for
    _close_opens to end."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait(
            {task, watch}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    if watch in done:
        watch.result()  # raises why the shell's process ended
    raise TimeoutError(f"the shell did not {what} within {READY_TIMEOUT_S:g} s")


class Supervisor:
    """One `bash --login -s` in the container, fed supervisor.sh, on FIFOs of the I/O dir."""

    def __init__(
        self, io_dir: Path, gen: int, fd_in: int, fd_out: int, fd_err: int, fd_life: int
    ) -> None:
        self.io_dir = io_dir
        self.gen = gen
        self.fd_in, self.fd_out, self.fd_err = fd_in, fd_out, fd_err
        # Read end of the FIFO only the supervisor process holds open: its end of file says the
        # supervisor is gone even while survivors of a command still hold the output FIFOs.
        self.fd_life = fd_life
        self.pid = 0
        self.token = secrets.token_hex(12)
        self.scanner = MarkerScanner(self.token)
        self.dead = False
        # Bytes of command lines the stdin pipe could not take yet, written when it drains.
        self._pending: bytearray | None = None
        self.paused = False
        # Where output and markers go: the running command's handlers, or nowhere between
        # commands.
        self.sink: Callable[[int, bytes], None] | None = None
        self.on_marker: Callable[[bytes], None] | None = None
        self.on_eof: Callable[[], None] | None = None
        # Set when a command ended by its early end marker W: until the supervisor's E for it,
        # what arrives is its survivors' (dropped), and the next command's line is held back,
        # so that command cannot start before the node has seen that E.
        self.awaiting_end = False
        self._held: bytearray | None = None
        self.dropped_held = False
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[int] | None = None
        self._early = b""

    @classmethod
    async def start(
        cls,
        backend: ContainerRuntime,
        container_id: str,
        io_dir: Path,
        env: Mapping[str, str],
    ) -> Supervisor:
        gen = next(_generation)
        names = {k: io_dir / f"{k}.{gen}" for k in ("in", "out", "err", "life", *_SIDE_FIFOS)}
        for path in names.values():
            make_fifo(path)
        # Non-blocking, so it opens with no writer yet; it is watched only once the supervisor
        # has opened its end (before `ready`).
        fd_life = os.open(names["life"], os.O_RDONLY | os.O_NONBLOCK)
        flags = {"in": os.O_WRONLY, "out": os.O_RDONLY, "err": os.O_RDONLY}
        opens = {k: open_fifo_end(names[k], f) for k, f in flags.items()}
        inside = {k: f"{CONTAINER_IO_DIR}/{k}.{gen}" for k in names}
        argv = [
            "bash",
            "-c",
            'exec bash --login -s <"$0" >"$1" 2>"$2"',
            inside["in"],
            inside["out"],
            inside["err"],
        ]
        sup: Supervisor | None = None
        watch: asyncio.Future[None] | None = None
        try:
            exec_id = await backend.exec_detached(container_id, argv)
            watch = asyncio.ensure_future(_watch_start(backend, container_id, exec_id))
            await _unless_ended(asyncio.wait(opens.values()), watch, "open its FIFOs")
            fds = {k: t.result() for k, t in opens.items()}
            sup = cls(io_dir, gen, fds["in"], fds["out"], fds["err"], fd_life)
            sup._attach()
            boot = (
                f"__swerl_io={CONTAINER_IO_DIR}; __swerl_ctl={inside['ctl']};"
                f" __swerl_baton0={inside['baton0']}; __swerl_baton1={inside['baton1']};"
                f" __swerl_life={inside['life']}; __swerl_token={sup.token}\n".encode()
                + SUPERVISOR_SCRIPT
                + b"\n"
                + env_script(env).encode()
                + b"\n__swerl_start\n"
            )
            await sup.write(boot)
            await _unless_ended(sup._await_ready(), watch, "report ready")
            sup._watch_life()
        except BaseException as exc:
            # Any way out (errors, and cancellation when the sandbox is destroyed meanwhile)
            # must unblock the threads still opening FIFOs, or they stay blocked for good.
            if sup is not None:
                sup.close()
            else:
                os.close(fd_life)
                # Shielded: a second cancel (a loop shutting down) must not leave one behind.
                with contextlib.suppress(BaseException):
                    await asyncio.shield(_close_opens(opens, names))
            if not isinstance(exc, (TimeoutError, asyncio.TimeoutError, OSError, EOFError)):
                raise
            raise ShellUnavailable(
                f"the sandbox's shell did not start ({type(exc).__name__}: {exc}); does the"
                " image have bash?",
                container_id=container_id[:12],
            ) from exc
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(BaseException):
                    await watch
            # Both ends of the stdio FIFOs are open now (or never will be): unlink the names.
            for key in ("in", "out", "err", "life"):
                with contextlib.suppress(OSError):
                    names[key].unlink()
        return sup

    def _attach(self) -> None:
        for fd in (self.fd_in, self.fd_out, self.fd_err):
            os.set_blocking(fd, False)
        self._loop.add_reader(self.fd_out, self._readable, self.fd_out, STDOUT)
        self._loop.add_reader(self.fd_err, self._readable, self.fd_err, STDERR)

    async def _await_ready(self) -> None:
        self._ready = self._loop.create_future()
        self.pid = await self._ready

    def _watch_life(self) -> None:
        self._loop.add_reader(self.fd_life, self._life_readable)

    def gone(self) -> bool:
        """Whether the supervisor process has ended (its life FIFO is at end of file); one
        non-blocking read, cheap enough for every early end."""
        if self.dead:
            return True
        try:
            return not os.read(self.fd_life, 64)
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _life_readable(self) -> None:
        try:
            if os.read(self.fd_life, 64):
                return  # nobody writes to it; nothing to do with bytes
        except BlockingIOError:
            return
        except OSError:
            pass
        self._loop.remove_reader(self.fd_life)
        # The supervisor is gone. What it wrote before it went is read first (an E it sent
        # just before counts), then its output counts as ended, whoever still holds the FIFO.
        for _ in range(64):
            if self.dead or not self._readable(self.fd_out, STDOUT):
                break
        if not self.dead:
            self._eof()

    def _readable(self, fd: int, stream: int) -> bool:
        """Reads and dispatches one chunk; False when there was nothing to read."""
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            if stream == STDOUT:
                self._eof()
            else:
                self._loop.remove_reader(fd)
            return False
        if self._ready is not None and not self._ready.done():
            # Anything the login profile prints before the ready marker is not command output.
            if stream == STDOUT:
                self._early = (self._early + data)[-4096:]
                match = re.search(rb"\0SWERL:ready:(\d+)\0", self._early)
                if match:
                    self._ready.set_result(int(match.group(1)))
            return True
        if stream == STDERR:
            if self.sink is not None and not self.awaiting_end:
                self.sink(STDERR, data)
            return True
        for is_marker, payload in self.scanner.feed(data):
            if self.awaiting_end:
                if is_marker and payload.startswith(b"E:"):
                    self._end_seen()
            elif is_marker:
                if self.on_marker is not None:
                    self.on_marker(payload)
            elif self.sink is not None:
                self.sink(STDOUT, payload)
        return True

    def drain_stderr(self) -> None:
        """Reads what the command left in the stderr FIFO (called once its end marker arrived);
        with no command to take it, it is dropped."""
        while True:
            try:
                data = os.read(self.fd_err, READ_CHUNK)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            if self.sink is not None:
                self.sink(STDERR, data)

    def ended_early(self) -> None:
        """The running command ended by its W marker: wait for the supervisor's E."""
        self.awaiting_end = True

    def _end_seen(self) -> None:
        self.awaiting_end = False
        # What survivors wrote to stderr after W: no command's (the next one has not started).
        sink, self.sink = self.sink, None
        self.drain_stderr()
        self.sink = sink
        held, self._held = self._held, None
        if held:
            self.send(bytes(held))

    def _eof(self) -> None:
        self.close()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(
                EOFError("shell exited: " + self._early[-300:].decode(errors="replace"))
            )
        if self.on_eof is not None:
            self.on_eof()

    def pause(self) -> None:
        if not self.paused and not self.dead:
            self.paused = True
            self._loop.remove_reader(self.fd_out)
            self._loop.remove_reader(self.fd_err)

    def resume(self) -> None:
        if self.paused and not self.dead:
            self.paused = False
            self._loop.add_reader(self.fd_out, self._readable, self.fd_out, STDOUT)
            self._loop.add_reader(self.fd_err, self._readable, self.fd_err, STDERR)

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.dead:
                raise EOFError("shell is gone")
            try:
                written = os.write(self.fd_in, view)
                view = view[written:]
            except BlockingIOError:
                ready = self._loop.create_future()
                self._loop.add_writer(self.fd_in, ready.set_result, None)
                try:
                    await ready
                finally:
                    self._loop.remove_writer(self.fd_in)
            except BrokenPipeError as exc:
                self._eof()
                raise EOFError("shell is gone") from exc

    def send(self, data: bytes) -> None:
        """Writes to the shell's stdin without waiting: what the pipe cannot take now is written,
        in order, as it drains. A shell found gone is handled as its end of output."""
        if self.awaiting_end:
            if self._held is None:
                self._held = bytearray()
            self._held += data
            return
        if self._pending is not None:
            self._pending += data
            return
        try:
            written = os.write(self.fd_in, data)
        except BlockingIOError:
            written = 0
        except OSError:
            self._eof()
            return
        if written < len(data):
            self._pending = bytearray(data[written:])
            self._loop.add_writer(self.fd_in, self._flush)

    def _flush(self) -> None:
        assert self._pending is not None
        try:
            written = os.write(self.fd_in, self._pending)
        except BlockingIOError:
            return
        except OSError:
            self._eof()
            return
        del self._pending[:written]
        if not self._pending:
            self._pending = None
            self._loop.remove_writer(self.fd_in)

    def close(self) -> None:
        if self.dead:
            return
        self.dead = True
        # A command line held back (awaiting E) never reached a worker: its run starts over on
        # the next supervisor (CommandRun._on_eof).
        self.dropped_held = bool(self._held)
        self._held = None
        if self._pending is not None:
            self._pending = None
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self.fd_in)
        for fd in (self.fd_out, self.fd_err, self.fd_life):
            with contextlib.suppress(Exception):
                self._loop.remove_reader(fd)
        for fd in (self.fd_in, self.fd_out, self.fd_err, self.fd_life):
            with contextlib.suppress(OSError):
                os.close(fd)
        for name in _SIDE_FIFOS:
            with contextlib.suppress(OSError):
                (self.io_dir / f"{name}.{self.gen}").unlink()
