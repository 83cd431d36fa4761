"""Commands in a sandbox through one long-lived shell instead of one `docker exec` each.

Every sandbox has an I/O directory on the node, bind-mounted into the container at /.swerl-io.
A `Supervisor` is a `bash --login -s` inside the container whose stdin, stdout and stderr are
FIFOs in that directory, fed `supervisor.sh`. Each command is one line of bash written to it;
its output comes back on the FIFOs directly (dockerd is not on the data path), framed on stdout by
NUL-delimited markers carrying a per-supervisor token. A round trip costs about a millisecond
instead of the ~60 ms of a `docker exec`. The protocol, with the state tables of both sides, is
docs/shell-protocol.md (rows N1-N15 there are this module's side).

`SandboxShell` owns the supervisor of one sandbox and the shell's turn: one command at a time,
callers queued in arrival order. A `CommandRun` is one command: the FIFO readers feed it from
event-loop callbacks into a queue the caller consumes (reading pauses while the caller lags), so
a caller that goes away (cancelled RPC) only marks the run abandoned: the command's process group
is killed and the supervisor is back in step for the next command, or replaced if it is not.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import itertools
import os
import re
import secrets
import stat
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from swerl.exec.docker_backend import ContainerState, DockerBackend
from swerl.exec.errors import (
    CwdNotFound,
    InvalidCommand,
    SandboxContainerRemoved,
    SandboxNotRunning,
    ShellUnavailable,
)
from swerl.exec.output import STDERR, STDOUT, OutputCap

log = structlog.get_logger(__name__)

SUPERVISOR_SCRIPT = (Path(__file__).with_name("supervisor.sh")).read_bytes()
# Where a sandbox's I/O directory is mounted inside its container.
CONTAINER_IO_DIR = "/.swerl-io"
# Seconds the node waits past a command's own timeout before it steps in from outside (N13): the
# in-container watchdog fires on time unless a command stopped or killed it (or the supervisor).
BACKSTOP_GRACE_S = 0.5
# After stepping in, how long the node waits for the command's end before it ends the call
# itself: the backstop and this together stay under the promised timeout + 1 s.
GIVE_UP_S = 0.4
# After a cancelled caller's command was killed, how long to wait for the supervisor to report
# before replacing it (nobody waits on the call; the next command does).
RESYNC_S = 2.0
# A container that stops this many times within RESTART_WINDOW_S is not started again: something
# kills it as soon as it runs (e.g. out of memory at once), and the sandbox is lost.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
READY_TIMEOUT_S = 60.0
READ_CHUNK = 256 * 1024
# Output events queued for a slow caller before the FIFOs stop being read (backpressure).
PAUSE_AT, RESUME_AT = 64, 8
# FIFOs of a supervisor besides its stdio: the watchdog's and the workers' batons.
_SIDE_FIFOS = ("ctl", "baton0", "baton1")
# The watchdog reads a timeout as %012.3f seconds.
MAX_TIMEOUT_S = 99_999_999.0
# The signals a caller can send a running command (names for `kill -s`).
SIGNALS = ("INT", "TERM", "KILL")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_generation = itertools.count(1)


# Bytes that cannot stand as themselves inside $'...': the quote and backslash, control bytes
# and everything outside ASCII (escaped so a framed command's length in bytes is its length in
# characters whatever the container's locale).
_NEEDS_ESCAPE = re.compile(rb"[\x00-\x1f\x27\x5c\x7f-\xff]")
_ESCAPES = {
    byte: (b"\\" + bytes([byte]) if byte in (0x5C, 0x27) else b"\\%03o" % byte)
    for byte in range(256)
}


def _escape(match: re.Match[bytes]) -> bytes:
    return _ESCAPES[match[0][0]]


def bash_quote(value: str) -> bytes:
    """ANSI-C quoting ($'...') that round-trips any NUL-free text, newlines included; the
    result is ASCII."""
    raw = value.encode("utf-8", "surrogateescape")
    if b"\0" in raw:
        raise InvalidCommand("commands, paths and environment values cannot contain NUL bytes")
    return b"$'" + _NEEDS_ESCAPE.sub(_escape, raw) + b"'"


def frame(line: bytes) -> bytes:
    """A command line as the workers read it: 8 decimal digits of length, then the line."""
    if len(line) > 99_999_999:
        raise InvalidCommand("the command, its cwd and environment are too large once quoted")
    return b"%08d" % len(line) + line


def env_script(env: Mapping[str, str]) -> str:
    """`export K=V` lines for a command's extra environment (validated names)."""
    lines = []
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            raise InvalidCommand(f"invalid environment variable name {name!r}")
        lines.append(f"export {name}={bash_quote(value).decode('utf-8', 'surrogateescape')}")
    return "\n".join(lines)


@dataclass(frozen=True)
class CommandSpec:
    command: str
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 180.0
    max_output_bytes: int = 1 << 20
    session: bool = False
    open_stdin: bool = False
    notify_started: bool = False


@dataclass(frozen=True)
class Started:
    pgid: int


@dataclass(frozen=True)
class Output:
    stream: int  # STDOUT | STDERR
    data: bytes


@dataclass(frozen=True)
class Exit:
    exit_code: int
    timed_out: bool
    output_truncated: bool
    bytes_dropped: int
    duration_s: float
    signaled: bool
    # The sandbox's container had stopped (a command killed every process) and was started
    # again, filesystem intact, before this command ran.
    sandbox_restarted: bool = False


Event = Started | Output | Exit


class MarkerScanner:
    """Splits stdout into data and `\\0SWERL:<id>:<body>\\0` markers.

    A marker counts when its id is the supervisor's token or, for the early end marker W, the
    one-time end id of the command running now (`end_id`); anything else that looks like one is
    output, byte for byte.
    """

    START = b"\0SWERL:"
    # Longer than any marker we write: a "marker" that runs on past this is output.
    MAX_MARKER = 128

    def __init__(self, token: str) -> None:
        self.token = token.encode()
        self.end_id = b""
        self._buf = b""

    def feed(self, data: bytes) -> list[tuple[bool, bytes]]:
        """(False, data) for output and (True, body) for markers, in order."""
        buf = self._buf + data if self._buf else data
        self._buf = b""
        out: list[tuple[bool, bytes]] = []
        start = search = 0
        while True:
            i = buf.find(self.START, search)
            if i < 0:
                break
            end = buf.find(b"\0", i + len(self.START), i + self.MAX_MARKER)
            if end < 0:
                if len(buf) - i < self.MAX_MARKER:  # the marker is not complete yet
                    if i > start:
                        out.append((False, buf[start:i]))
                    self._buf = buf[i:]
                    return out
                search = i + 1  # too long to be a marker
                continue
            marker_id, _, body = buf[i + len(self.START) : end].partition(b":")
            if marker_id != self.token and not (
                marker_id == self.end_id and self.end_id and body.startswith(b"W:")
            ):
                search = i + 1  # looks like one, but is not ours: output
                continue
            if i > start:
                out.append((False, buf[start:i]))
            out.append((True, body))
            start = search = end + 1
        # Hold back a tail that could be the beginning of a marker split across reads.
        keep = 0
        nul = buf.rfind(b"\0", max(start, len(buf) - len(self.START) + 1))
        if nul >= 0 and self.START.startswith(buf[nul:]):
            keep = len(buf) - nul
        if len(buf) - keep > start:
            out.append((False, buf[start : len(buf) - keep]))
        if keep:
            self._buf = buf[len(buf) - keep :]
        return out


def _mkfifo(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.mkfifo(path, 0o600)


def _unblock_fifo(path: Path) -> None:
    """Opens the other end of a FIFO so a thread blocked opening it returns."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))


async def _close_opens(opens: Mapping[str, asyncio.Future[int]], names: Mapping[str, Path]) -> None:
    """Ends the FIFO opens of a shell that will not start and closes what they opened.

    Each FIFO still being opened gets a peer held open (O_RDWR) until its open has returned:
    an open still queued on the default executor (every worker busy, e.g. three opens per
    starting shell and six workers on a 2-core node) calls os.open only later, and a peer
    opened and closed at once before that left it blocked for good (and the FIFO's name is
    removed with the sandbox's I/O dir, so nothing could open it again)."""
    peers: list[int] = []
    try:
        for key, task in opens.items():
            if not task.done():
                with contextlib.suppress(OSError):
                    peers.append(os.open(names[key], os.O_RDWR | os.O_NONBLOCK))
        await asyncio.wait(opens.values())
    finally:
        for fd in peers:
            os.close(fd)
        for task in opens.values():
            if task.done() and not task.cancelled() and task.exception() is None:
                os.close(task.result())


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
        backend: DockerBackend,
        container_id: str,
        io_dir: Path,
        env: Mapping[str, str],
    ) -> Supervisor:
        gen = next(_generation)
        names = {k: io_dir / f"{k}.{gen}" for k in ("in", "out", "err", "life", *_SIDE_FIFOS)}
        for path in names.values():
            _mkfifo(path)
        # Non-blocking, so it opens with no writer yet; it is watched only once the supervisor
        # has opened its end (before `ready`).
        fd_life = os.open(names["life"], os.O_RDONLY | os.O_NONBLOCK)
        flags = {"in": os.O_WRONLY, "out": os.O_RDONLY, "err": os.O_RDONLY}
        opens = {
            k: asyncio.ensure_future(asyncio.to_thread(os.open, names[k], f))
            for k, f in flags.items()
        }
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
        try:
            await backend.exec_detached(container_id, argv)
            done, _ = await asyncio.wait(opens.values(), timeout=READY_TIMEOUT_S)
            if len(done) != len(opens):
                raise TimeoutError("the shell did not open its FIFOs")
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
            await asyncio.wait_for(sup._await_ready(), READY_TIMEOUT_S)
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


class SandboxShell:
    """The command runner of one sandbox: one supervisor, one command at a time."""

    def __init__(
        self, backend: DockerBackend, container_id: str, io_dir: Path, env: Mapping[str, str]
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
        except ShellUnavailable:
            state = await self._backend.container_state(self.container_id)
            if state is not None and state.running:
                raise
            sup = await self._start_container_again(state)
        self.supervisor = sup
        return sup

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
        refused = await self._backend.start(self.container_id)
        if refused:
            raise self._lose(self._not_running(f"Docker refuses to start it ({refused})"))
        try:
            sup = await Supervisor.start(self._backend, self.container_id, self.io_dir, self._env)
        except ShellUnavailable as exc:
            again = await self._backend.container_state(self.container_id)
            if again is not None and again.running:
                raise  # the container runs: the shell's own trouble, not the sandbox's
            raise self._lose(
                self._not_running(f"it stopped again right after a start ({_how_it_ended(again)})")
            ) from exc
        self._restarted = True
        log.warning("sandbox.restarted", container_id=short)
        return sup

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

    def _not_running(self, why: str) -> SandboxNotRunning:
        return SandboxNotRunning(
            f"the sandbox's container stopped and cannot be started again: {why}; destroy the"
            " sandbox and create another",
            container_id=self.container_id[:12],
        )

    def spawn(self, coro) -> asyncio.Task[None]:
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

    def __init__(self, shell: SandboxShell, spec: CommandSpec) -> None:
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
        self._finished_waiters: list[asyncio.Future[None]] = []
        self._stdin_fifo = shell.io_dir / f"stdin.{self.nonce}" if spec.open_stdin else None
        self._stdin_fd: int | None = None
        self._stdin_ready: asyncio.Event | None = asyncio.Event() if spec.open_stdin else None
        self._opening: asyncio.Future[int] | None = None
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
            await asyncio.wait_for(self.wait_finished(), RESYNC_S)
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
        self._end_now(timed_out=bool(pgid) and self._shell.timed_out_pgid() == pgid)

    def _end_now(self, *, timed_out: bool) -> None:
        """Ends the run at once with 137 (killed), without waiting for anything in the
        container; the turn stays held until the shell is put right (SandboxShell.reset)."""
        sup = self._sup
        pgid = self._shell.current_pgid(self.nonce)
        if sup is not None:
            sup.sink = sup.on_marker = sup.on_eof = None
            sup.close()
        self._exit_code = 137
        self._timed_out = self._timed_out or timed_out
        self._finish(137, keep_turn=True)
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
            _unblock_fifo(self._stdin_fifo)
            opening.add_done_callback(_close_opened)
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
                _mkfifo(self._stdin_fifo)
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
        loop = asyncio.get_running_loop()
        self._backstop = loop.call_later(spec.timeout_s + BACKSTOP_GRACE_S, self._backstop_fire)
        if self._stdin_fifo is not None:
            self._opening = asyncio.ensure_future(
                asyncio.to_thread(os.open, self._stdin_fifo, os.O_WRONLY)
            )
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
            if self._state == _FINISHED:
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


def _how_it_ended(state: ContainerState | None) -> str:
    if state is None:
        return "removed"
    how = f"exit code {state.exit_code}"
    if state.oom_killed:
        how += ", out of memory"
    if state.error:
        how += f", {state.error}"
    return how


def _close_opened(opening: asyncio.Future[int]) -> None:
    """Closes the descriptor an abandoned open produced, if it produced one."""
    if not opening.cancelled() and opening.exception() is None:
        os.close(opening.result())


def ensure_io_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not stat.S_ISDIR(path.stat().st_mode):
        raise OSError(errno.ENOTDIR, f"{path} is not a directory")
    return path
