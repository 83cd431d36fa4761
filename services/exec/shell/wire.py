"""The wire between the node and a sandbox's shell: quoting, framing, markers and the FIFOs.

A command reaches the supervisor as one framed line (`frame`: 8 decimal digits of length, then
the line) whose fields are ANSI-C quoted (`bash_quote`); its end and other events come back on
stdout as NUL-delimited markers that `MarkerScanner` tells apart from output. Every FIFO lives in
the sandbox's I/O directory on the node, mounted in the container at `CONTAINER_IO_DIR`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import stat
import threading
from collections.abc import Mapping
from pathlib import Path

from swerl.exec.errors import InvalidCommand

# Where a sandbox's I/O directory is mounted inside its container.
CONTAINER_IO_DIR = "/.swerl-io"
# The watchdog reads a timeout as %012.3f seconds.
MAX_TIMEOUT_S = 99_999_999.0
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

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


def make_fifo(path: Path) -> None:
    """A fresh FIFO at `path` (one left by an earlier shell is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.mkfifo(path, 0o600)


def open_fifo_end(path: Path, flags: int) -> asyncio.Future[int]:
    """`os.open` of one end of a FIFO, which blocks until its other end is opened, on a daemon
    thread of its own: never on the loop's default executor, whose threads a closing event loop
    joins (`shutdown_default_executor`), so one open that never met its peer hung the shutdown
    of the whole process (and of a test's loop) for good. The descriptor goes to the returned
    future; if nobody wants it when it comes (the future was cancelled, or the loop has closed)
    it is closed."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def deliver(fd: int | None, error: OSError | None) -> None:
        if future.cancelled():
            if fd is not None:
                os.close(fd)
        elif error is not None:
            future.set_exception(error)
        else:
            assert fd is not None
            future.set_result(fd)

    def run() -> None:
        fd: int | None = None
        error: OSError | None = None
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(deliver, fd, error)
        except RuntimeError:  # the loop has closed: nobody will take it
            if fd is not None:
                os.close(fd)

    threading.Thread(target=run, name=f"swerl-fifo-open-{path.name}", daemon=True).start()
    return future


def unblock_fifo(path: Path) -> None:
    """Opens the other end of a FIFO so a thread blocked opening it returns."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))


def ensure_io_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not stat.S_ISDIR(path.stat().st_mode):
        raise OSError(errno.ENOTDIR, f"{path} is not a directory")
    return path
