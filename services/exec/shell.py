"""Commands in a sandbox through one long-lived shell instead of one `docker exec` each.

A `Supervisor` is a `bash --login -s` inside the container, reached through a single hijacked
`docker exec` socket and fed `supervisor.sh`. Each command is one line of bash sent to it; its
output comes back on the same socket, framed by NUL-delimited markers that carry a per-command
nonce (see supervisor.sh). That makes a round trip about a millisecond instead of ~60 ms.

`SandboxShell` owns the supervisor of one sandbox and runs one command at a time (callers queue
on its lock, in arrival order). A `CommandRun` is one command: a driver task reads the socket and
feeds a bounded queue that the caller consumes, so a caller that goes away (cancelled RPC) only
flips the run into "abandoned": the driver kills the command's process group and keeps reading
until the supervisor is back in step, or replaces the supervisor when it is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import struct
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from swerl.exec.docker_backend import DockerBackend, HijackedExec
from swerl.exec.errors import InvalidCommand, ShellUnavailable
from swerl.exec.output import STDERR, STDOUT, OutputCap

log = structlog.get_logger(__name__)

SUPERVISOR_SCRIPT = (Path(__file__).with_name("supervisor.sh")).read_bytes()
# Seconds the node waits past a command's own timeout before it kills from outside: the
# in-container watchdog should always have fired first.
BACKSTOP_GRACE_S = 5.0
# After killing from outside, how long to wait for the supervisor to report before replacing it.
RESYNC_S = 5.0
READY_TIMEOUT_S = 60.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SIGNALS = {"INT": 2, "TERM": 15, "KILL": 9}


def bash_quote(value: str) -> bytes:
    """ANSI-C quoting ($'...') that round-trips any NUL-free text, newlines included."""
    raw = value.encode("utf-8", "surrogateescape")
    if b"\0" in raw:
        raise InvalidCommand("commands, paths and environment values cannot contain NUL bytes")
    out = bytearray(b"$'")
    for byte in raw:
        if byte in (0x5C, 0x27):  # backslash, single quote
            out += b"\\" + bytes([byte])
        elif byte < 0x20 or byte == 0x7F:
            out += b"\\%03o" % byte
        else:
            out.append(byte)
    out += b"'"
    return bytes(out)


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


Event = Started | Output | Exit


class MarkerScanner:
    """Splits one output stream into data and `\\0SWERL:<nonce>:...\\0` markers."""

    def __init__(self, nonce: str) -> None:
        self.prefix = b"\0SWERL:" + nonce.encode() + b":"
        self._buf = b""

    def feed(self, data: bytes) -> list[tuple[bytes | None, bytes]]:
        """Returns (None, data) for output and (b"marker", body) for markers, in order."""
        buf = self._buf + data if self._buf else data
        out: list[tuple[bytes | None, bytes]] = []
        start = 0
        while True:
            i = buf.find(self.prefix, start)
            if i < 0:
                break
            end = buf.find(b"\0", i + len(self.prefix))
            if end < 0:  # marker not complete yet
                if i > start:
                    out.append((None, buf[start:i]))
                self._buf = buf[i:]
                return out
            if i > start:
                out.append((None, buf[start:i]))
            out.append((b"marker", buf[i + len(self.prefix) : end]))
            start = end + 1
        # Hold back a tail that could be the beginning of a marker split across chunks.
        keep = 0
        nul = buf.rfind(b"\0", max(start, len(buf) - len(self.prefix) + 1))
        if nul >= 0 and self.prefix.startswith(buf[nul:]):
            keep = len(buf) - nul
        if len(buf) - keep > start:
            out.append((None, buf[start : len(buf) - keep]))
        self._buf = buf[len(buf) - keep :] if keep else b""
        return out


class Supervisor:
    """One `bash --login -s` in the container, fed supervisor.sh, on a hijacked exec socket."""

    def __init__(self, hijack: HijackedExec, reader: asyncio.StreamReader, writer) -> None:
        self._hijack = hijack
        self.reader = reader
        self.writer = writer
        self.pid = 0
        self.dead = False

    @classmethod
    async def start(
        cls, backend: DockerBackend, container_id: str, env: Mapping[str, str]
    ) -> Supervisor:
        hijack = await backend.exec_hijacked(container_id, ["bash", "--login", "-s"])
        hijack.sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=hijack.sock, limit=1 << 20)
        sup = cls(hijack, reader, writer)
        boot = SUPERVISOR_SCRIPT + b"\n" + env_script(env).encode() + b"\n__swerl_ready\n"
        writer.write(boot)
        try:
            await asyncio.wait_for(sup._await_ready(), READY_TIMEOUT_S)
        except (TimeoutError, asyncio.TimeoutError, ConnectionError, EOFError) as exc:
            sup.close()
            raise ShellUnavailable(
                f"the sandbox's shell did not start ({type(exc).__name__}); does the image"
                " have bash?",
                container_id=container_id[:12],
            ) from exc
        return sup

    async def _await_ready(self) -> None:
        # Anything the login profile prints before the ready markers is not a command's output.
        seen: dict[int, bytes] = {STDOUT: b"", STDERR: b""}
        ready = re.compile(rb"\0SWERL:ready:(\d+)\0")
        found: set[int] = set()
        while found != {STDOUT, STDERR}:
            frame = await self.read_frame()
            if frame is None:
                raise EOFError("".join(v.decode(errors="replace") for v in seen.values())[-500:])
            stream, data = frame
            seen[stream] = (seen[stream] + data)[-4096:]
            match = ready.search(seen[stream])
            if match:
                self.pid = int(match.group(1))
                found.add(stream)

    async def read_frame(self) -> tuple[int, bytes] | None:
        """One frame of Docker's stream multiplexing; None at end of stream."""
        try:
            header = await self.reader.readexactly(8)
            (size,) = struct.unpack(">I", header[4:])
            data = await self.reader.readexactly(size) if size else b""
        except (asyncio.IncompleteReadError, ConnectionError):
            self.dead = True
            return None
        return header[0], data

    def send(self, line: bytes) -> None:
        self.writer.write(line)

    def close(self) -> None:
        self.dead = True
        with contextlib.suppress(Exception):
            self.writer.close()


class SandboxShell:
    """The command runner of one sandbox: one supervisor, one command at a time."""

    def __init__(self, backend: DockerBackend, container_id: str, env: Mapping[str, str]):
        self._backend = backend
        self.container_id = container_id
        self._env = dict(env)
        self._lock = asyncio.Lock()
        self._supervisor: Supervisor | None = None
        self._runs: set[asyncio.Task[None]] = set()
        self.closed = False

    async def _ensure_supervisor(self) -> Supervisor:
        sup = self._supervisor
        if sup is None or sup.dead:
            if sup is not None:
                log.info("shell.restart", container_id=self.container_id[:12])
            sup = await Supervisor.start(self._backend, self.container_id, self._env)
            self._supervisor = sup
        return sup

    def start(self, spec: CommandSpec) -> CommandRun:
        if not spec.command.strip():
            raise InvalidCommand("empty command")
        run = CommandRun(self, spec)
        task = asyncio.get_running_loop().create_task(run.drive())
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)
        return run

    async def run_capture(
        self, command: str, *, timeout_s: float, max_output_bytes: int, cwd: str = ""
    ) -> tuple[int, bytes, bytes, bool]:
        """Runs a command to completion: (exit_code, stdout, stderr, truncated)."""
        run = self.start(
            CommandSpec(command, cwd=cwd, timeout_s=timeout_s, max_output_bytes=max_output_bytes)
        )
        out = {STDOUT: bytearray(), STDERR: bytearray()}
        exit_event: Exit | None = None
        async with contextlib.aclosing(run.events()) as events:
            async for event in events:
                if isinstance(event, Output):
                    out[event.stream] += event.data
                elif isinstance(event, Exit):
                    exit_event = event
        assert exit_event is not None
        return (
            exit_event.exit_code,
            bytes(out[STDOUT]),
            bytes(out[STDERR]),
            exit_event.output_truncated,
        )

    async def kill_group(self, pgid: int, signal: str = "KILL") -> None:
        """Signals a command's process group from a side `docker exec` (~60 ms, rare)."""
        with contextlib.suppress(Exception):
            await self._backend.exec_run(
                self.container_id, ["bash", "-c", f"kill -s {signal} -- -{int(pgid)}"]
            )

    async def kill_supervisor(self, sup: Supervisor) -> None:
        sup.close()
        if sup.pid:
            with contextlib.suppress(Exception):
                await self._backend.exec_run(
                    self.container_id, ["bash", "-c", f"kill -KILL {int(sup.pid)}"]
                )

    async def open_stdin_writer(self, path: str) -> HijackedExec:
        return await self._backend.exec_hijacked(
            self.container_id, ["bash", "-c", 'exec cat >"$0"', path]
        )

    async def close(self) -> None:
        self.closed = True
        for task in list(self._runs):
            task.cancel()
        if self._supervisor is not None:
            self._supervisor.close()


_DONE = object()


class CommandRun:
    """One command: `events()` yields Started, Output..., then exactly one Exit."""

    def __init__(self, shell: SandboxShell, spec: CommandSpec) -> None:
        self._shell = shell
        self.spec = spec
        self.nonce = secrets.token_hex(8)
        self._queue: asyncio.Queue[object] = asyncio.Queue(maxsize=64)
        self._abandoned = False
        self._kill_requested: str | None = None
        self._signaled = False
        self.pgid = 0
        self._pgid_known = asyncio.Event()
        self._stdin_path = f"/tmp/.swerl/in.{self.nonce}" if spec.open_stdin else ""
        self._stdin: tuple[HijackedExec, asyncio.StreamWriter] | None = None
        self._stdin_ready = asyncio.Event()
        self._finished = asyncio.Event()

    # -- consumer side --------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        while True:
            item = await self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
            if isinstance(item, Exit):
                return

    def abandon(self) -> None:
        """The caller is gone: kill the command; the driver re-synchronises on its own."""
        if self._finished.is_set():
            return
        self._abandoned = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self.request_kill("KILL", from_client=False)
        asyncio.get_running_loop().create_task(self._replace_if_stuck())

    async def _replace_if_stuck(self) -> None:
        # The kill should bring the end markers within milliseconds; if not, the supervisor is
        # wedged and the next command must get a fresh one.
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(self._finished.wait(), RESYNC_S)
            return
        sup = self._shell._supervisor
        if sup is not None:
            await self._shell.kill_supervisor(sup)

    def request_kill(self, signal: str, *, from_client: bool = True) -> None:
        if self._finished.is_set():
            return
        if from_client:
            self._signaled = True
        self._kill_requested = signal
        asyncio.get_running_loop().create_task(self._deliver_signal(signal))

    async def _deliver_signal(self, signal: str) -> None:
        await self._pgid_known.wait()
        if not self._finished.is_set():
            await self._shell.kill_group(self.pgid, signal)

    async def write_stdin(self, data: bytes, close: bool) -> None:
        await self._stdin_ready.wait()
        if self._stdin is None:
            return
        writer = self._stdin[1]
        if data:
            writer.write(data)
            await writer.drain()
        if close and writer.can_write_eof():
            writer.write_eof()

    # -- driver side ----------------------------------------------------------------------
    async def _emit(self, event: object) -> None:
        if not self._abandoned:
            await self._queue.put(event)

    async def drive(self) -> None:
        try:
            async with self._shell._lock:
                await self._drive_locked()
        except BaseException as exc:  # surfaced to the consumer, never lost
            if not self._abandoned:
                self._queue.put_nowait(exc if isinstance(exc, Exception) else _DONE)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._finished.set()
            self._pgid_known.set()
            self._stdin_ready.set()
            if self._stdin is not None:
                with contextlib.suppress(Exception):
                    self._stdin[1].close()

    async def _drive_locked(self) -> None:
        shell, spec = self._shell, self.spec
        sup = await shell._ensure_supervisor()
        loop = asyncio.get_running_loop()
        line = b" ".join(
            [
                b"__swerl_run",
                self.nonce.encode(),
                f"{max(spec.timeout_s, 0.001):.3f}".encode(),
                b"s" if spec.session else b"i",
                bash_quote(spec.cwd),
                bash_quote(self._stdin_path),
                bash_quote(env_script(spec.env)),
                bash_quote(spec.command),
            ]
        )
        started_at = time.monotonic()
        sup.send(line + b"\n")
        scanners = {STDOUT: MarkerScanner(self.nonce), STDERR: MarkerScanner(self.nonce)}
        cap = OutputCap(max(spec.max_output_bytes, 2))
        ends: dict[int, int] = {}
        timed_out = False
        backstop = loop.call_later(spec.timeout_s + BACKSTOP_GRACE_S, self._backstop, sup)
        try:
            while len(ends) < 2:
                frame = await sup.read_frame()
                if frame is None:
                    break
                stream, data = frame
                if stream not in scanners:
                    continue
                for kind, payload in scanners[stream].feed(data):
                    if kind is None:
                        for out_stream, chunk in cap.feed(stream, payload):
                            await self._emit(Output(out_stream, chunk))
                    elif payload.startswith(b"S:"):
                        self.pgid = int(payload[2:])
                        self._pgid_known.set()
                        if self._stdin_path:
                            await self._connect_stdin()
                        await self._emit(Started(self.pgid))
                    elif payload == b"T":
                        timed_out = True
                    elif payload.startswith(b"E:"):
                        ends[stream] = int(payload[2:])
        finally:
            backstop.cancel()
        duration = time.monotonic() - started_at
        if len(ends) < 2:
            # The supervisor died under the command (e.g. `kill -9 $$`) or was replaced by the
            # backstop; its process group may still be alive.
            sup.close()
            if self.pgid:
                await shell.kill_group(self.pgid)
            exit_code = 137
            timed_out = timed_out or self._backstop_fired
        else:
            exit_code = ends.get(STDOUT, ends.get(STDERR, 0))
        for out_stream, chunk in cap.finish():
            await self._emit(Output(out_stream, chunk))
        await self._emit(
            Exit(
                exit_code=exit_code,
                timed_out=timed_out,
                output_truncated=cap.truncated,
                bytes_dropped=cap.dropped,
                duration_s=duration,
                signaled=self._signaled and not timed_out,
            )
        )

    _backstop_fired = False

    def _backstop(self, sup: Supervisor) -> None:
        """The in-container watchdog did not end the command: kill from outside, then reset."""
        self._backstop_fired = True
        log.warning("exec.backstop", container_id=self._shell.container_id[:12], pgid=self.pgid)

        async def escalate() -> None:
            if self.pgid:
                await self._shell.kill_group(self.pgid)
            await asyncio.sleep(RESYNC_S)
            if not self._finished.is_set():
                await self._shell.kill_supervisor(sup)

        asyncio.get_running_loop().create_task(escalate())

    async def _connect_stdin(self) -> None:
        try:
            hijack = await self._shell.open_stdin_writer(self._stdin_path)
            hijack.sock.setblocking(False)
            _, writer = await asyncio.open_connection(sock=hijack.sock)
            self._stdin = (hijack, writer)
        finally:
            self._stdin_ready.set()
