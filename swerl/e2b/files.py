"""E2B file operations of one sandbox, each a short bash script run as one Exec call.

The node has no file RPC; bytes go through the command's stdin (uploads) and stdout (downloads,
in segments under the node's output cap), so every operation uses only the public Exec call
with the lease's token. A script's exit code says which E2B error an operation gets.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import shlex
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from swerl.e2b.connect import ConnectError
from swerl.e2b.procs import ExecTarget
from swerl.exec.client import start_message
from swerl.exec.v1 import sandbox_pb2 as pb

NOT_FOUND, NOT_A_DIRECTORY, ALREADY_EXISTS, IS_A_DIRECTORY = 44, 45, 46, 47
# One download segment: one Exec call's output, under the node's output cap.
READ_SEGMENT_BYTES = 16 << 20
# One upload chunk: one ExecStdin message, under gRPC's default message limit.
WRITE_CHUNK_BYTES = 1 << 20
FILE_OP_TIMEOUT_S = 600.0

# find's description of an entry: type, target type, size, mode, permissions, owner, group,
# mtime, link target, path; NUL-separated.
_ENTRY_FORMAT = r"%y\0%Y\0%s\0%m\0%M\0%u\0%g\0%T@\0%l\0%p\0"
_ENTRY_FIELDS = 10
_TYPES = {"f": "FILE_TYPE_FILE", "d": "FILE_TYPE_DIRECTORY", "l": "FILE_TYPE_SYMLINK"}


@dataclass(frozen=True)
class ScriptResult:
    exit_code: int
    stdout: bytes
    stderr: bytes


def _resolve(path: str) -> str:
    """A bash expression of the path: relative paths are under the user's home, as in E2B."""
    if not path:
        raise ConnectError("invalid_argument", "the path is empty")
    if path.startswith("/"):
        return shlex.quote(path)
    return '"$HOME"/' + shlex.quote(path)


async def run_script(
    target: ExecTarget,
    script: str,
    *,
    stdin: AsyncIterator[bytes] | None = None,
    max_output_bytes: int = 1 << 20,
) -> ScriptResult:
    """Runs one script on the sandbox and gathers its output (stdin streamed when given)."""
    call = target.exec_call(FILE_OP_TIMEOUT_S)
    start = start_message(
        target.sandbox_id,
        script,
        timeout_s=FILE_OP_TIMEOUT_S,
        max_output_bytes=max_output_bytes,
        open_stdin=stdin is not None,
    )
    out = {pb.OUTPUT_STREAM_STDOUT: bytearray(), pb.OUTPUT_STREAM_STDERR: bytearray()}
    try:
        await call.write(pb.ExecRequest(start=start))
        if stdin is not None:
            async for chunk in stdin:
                for offset in range(0, len(chunk), WRITE_CHUNK_BYTES):
                    piece = chunk[offset : offset + WRITE_CHUNK_BYTES]
                    await call.write(pb.ExecRequest(stdin=pb.ExecStdin(data=piece)))
            await call.write(pb.ExecRequest(stdin=pb.ExecStdin(close=True)))
        await call.done_writing()
        while (response := await call.read()) is not grpc.aio.EOF:
            kind = response.WhichOneof("kind")
            if kind == "output":
                out[response.output.stream] += response.output.data
            elif kind == "exit":
                return ScriptResult(
                    response.exit.exit_code,
                    bytes(out[pb.OUTPUT_STREAM_STDOUT]),
                    bytes(out[pb.OUTPUT_STREAM_STDERR]),
                )
    except grpc.aio.AioRpcError as err:
        code = err.code()
        if code == grpc.StatusCode.NOT_FOUND:
            raise ConnectError("not_found", err.details() or "sandbox not found") from None
        raise ConnectError("unavailable", err.details() or code.name) from None
    finally:
        call.cancel()
    raise ConnectError("unavailable", "the file operation's call ended without an exit")


def _timestamp(epoch: str) -> str:
    moment = dt.datetime.fromtimestamp(float(epoch), tz=dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_entries(raw: bytes) -> list[dict[str, Any]]:
    fields = raw.split(b"\0")
    entries = []
    for i in range(0, len(fields) - _ENTRY_FIELDS + 1, _ENTRY_FIELDS):
        kind, target_kind, size, mode, perms, owner, group, mtime, link, path = (
            f.decode("utf-8", "replace") for f in fields[i : i + _ENTRY_FIELDS]
        )
        is_link = kind == "l"
        entry: dict[str, Any] = {
            "name": path.rstrip("/").rsplit("/", 1)[-1] or "/",
            "type": _TYPES.get(target_kind if is_link else kind, "FILE_TYPE_UNSPECIFIED"),
            "path": path,
            "size": size,
            "mode": int(mode, 8),
            "permissions": perms,
            "owner": owner,
            "group": group,
            "modifiedTime": _timestamp(mtime),
        }
        if is_link:
            entry["symlinkTarget"] = link
            entry["isSymlink"] = True
        entries.append(entry)
    return entries


def _check(result: ScriptResult, path: str) -> None:
    if result.exit_code == 0:
        return
    message = result.stderr.decode("utf-8", "replace").strip()
    if result.exit_code == NOT_FOUND:
        raise ConnectError("not_found", f"path {path} not found")
    if result.exit_code == NOT_A_DIRECTORY:
        raise ConnectError("invalid_argument", f"path {path} is not a directory")
    if result.exit_code == ALREADY_EXISTS:
        raise ConnectError("already_exists", f"path {path} already exists")
    if result.exit_code == IS_A_DIRECTORY:
        raise ConnectError("invalid_argument", f"path {path} is a directory")
    raise ConnectError("internal", message or f"exit status {result.exit_code} on {path}")


def _chown(user: str | None) -> str:
    """Gives a written path to the user it was written as (root needs nothing)."""
    if not user or user == "root":
        return ""
    return f'chown {shlex.quote(user)}: "$p" 2>/dev/null; '


def _exists_guard(var: str = "p") -> str:
    return f'{{ [ -e "${var}" ] || [ -L "${var}" ]; }} || exit {NOT_FOUND}; '


async def stat(target: ExecTarget, path: str) -> dict[str, Any]:
    script = (
        f"p={_resolve(path)}; {_exists_guard()}find \"$p\" -maxdepth 0 -printf '{_ENTRY_FORMAT}'"
    )
    result = await run_script(target, script)
    _check(result, path)
    entries = parse_entries(result.stdout)
    if not entries:
        raise ConnectError("not_found", f"path {path} not found")
    return entries[0]


async def list_dir(target: ExecTarget, path: str, depth: int) -> list[dict[str, Any]]:
    if depth < 1:
        raise ConnectError("invalid_argument", "depth should be at least 1")
    script = (
        f'p={_resolve(path)}; {_exists_guard()}[ -d "$p" ] || exit {NOT_A_DIRECTORY}; '
        f"find \"$p\" -mindepth 1 -maxdepth {int(depth)} -printf '{_ENTRY_FORMAT}'"
    )
    result = await run_script(target, script, max_output_bytes=32 << 20)
    _check(result, path)
    return parse_entries(result.stdout)


async def make_dir(target: ExecTarget, path: str, user: str | None) -> dict[str, Any]:
    owner = _chown(user)
    script = (
        f'p={_resolve(path)}; {{ [ -e "$p" ] || [ -L "$p" ]; }} && exit {ALREADY_EXISTS}; '
        f'mkdir -p -- "$p" || exit 1; {owner}'
        f"find \"$p\" -maxdepth 0 -printf '{_ENTRY_FORMAT}'"
    )
    result = await run_script(target, script)
    _check(result, path)
    return parse_entries(result.stdout)[0]


async def remove(target: ExecTarget, path: str) -> None:
    script = f'p={_resolve(path)}; {_exists_guard()}rm -rf -- "$p"'
    _check(await run_script(target, script), path)


async def move(target: ExecTarget, source: str, destination: str) -> dict[str, Any]:
    script = (
        f"p={_resolve(source)}; d={_resolve(destination)}; {_exists_guard()}"
        f'mkdir -p -- "$(dirname -- "$d")" && mv -f -- "$p" "$d" || exit 1; '
        f"find \"$d\" -maxdepth 0 -printf '{_ENTRY_FORMAT}'"
    )
    result = await run_script(target, script)
    _check(result, source)
    return parse_entries(result.stdout)[0]


async def file_size(target: ExecTarget, path: str) -> int:
    """Size of a regular file to download; not_found or invalid_argument (a directory)."""
    script = (
        f'p={_resolve(path)}; {_exists_guard()}[ -d "$p" ] && exit {IS_A_DIRECTORY}; '
        'stat -L -c %s -- "$p"'
    )
    result = await run_script(target, script)
    _check(result, path)
    return int(result.stdout.strip() or b"0")


async def read(target: ExecTarget, path: str, size: int) -> AsyncIterator[bytes]:
    """The file's first `size` bytes (its size when the download began) in segments of
    READ_SEGMENT_BYTES, one Exec call each; byte offsets, so a segment that comes back short
    (the file shrank or was rewritten meanwhile) ends the read there instead of skipping
    what followed it. Bytes it gained meanwhile are not read."""
    sent = 0
    while sent < size:
        want = min(READ_SEGMENT_BYTES, size - sent)
        script = (
            f'p={_resolve(path)}; {_exists_guard()}tail -c +{sent + 1} -- "$p" | head -c {want}'
        )
        result = await run_script(target, script, max_output_bytes=want + 1024)
        if sent and result.exit_code == NOT_FOUND:
            return  # removed since: the body is what was read
        _check(result, path)
        if result.stdout:
            yield result.stdout
        sent += len(result.stdout)
        if len(result.stdout) < want:
            return
        await asyncio.sleep(0)


async def write(
    target: ExecTarget, path: str, user: str | None, chunks: AsyncIterator[bytes]
) -> dict[str, Any]:
    owner = _chown(user)
    script = (
        f'p={_resolve(path)}; [ -d "$p" ] && exit {IS_A_DIRECTORY}; '
        f'mkdir -p -- "$(dirname -- "$p")" && cat > "$p" || exit 1; {owner}'
        'printf %s "$p"'
    )
    result = await run_script(target, script, stdin=chunks)
    _check(result, path)
    written = result.stdout.decode("utf-8", "replace")
    return {"name": written.rsplit("/", 1)[-1], "type": "file", "path": written}
