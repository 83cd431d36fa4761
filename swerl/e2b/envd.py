"""The E2B sandbox API (envd, `E2B_SANDBOX_URL`) for every sandbox on one endpoint.

Each request names its sandbox in `E2b-Sandbox-Id` and proves it with `X-Access-Token` (the
sandbox's envdAccessToken); the user comes from HTTP Basic (RPCs) or `username` (/files).
Connect RPCs: `process.Process` Start/Connect/List/SendInput/SendSignal/CloseStdin and
`filesystem.Filesystem` Stat/ListDir/MakeDir/Move/Remove; HTTP `/files` downloads and uploads
(octet-stream and multipart). Any other call answers `unimplemented` naming it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import BodyPartReader, web

from swerl.e2b import files
from swerl.e2b.connect import (
    STREAM_CONTENT_TYPE,
    ConnectError,
    end_of_stream,
    envelope,
    parse_json,
    timeout_s,
    unary_error,
    unwrap_envelope,
)
from swerl.e2b.procs import Process, ProcessConfig
from swerl.e2b.sandboxes import ApiError, Sandbox, SandboxRegistry

REGISTRY_KEY: web.AppKey[SandboxRegistry] = web.AppKey("envd_registry", SandboxRegistry)
MAX_FILE_KEY: web.AppKey[int] = web.AppKey("max_file_bytes", int)
DEFAULT_KEEPALIVE_S = 50.0

Unary = Callable[[Sandbox, dict[str, Any], str | None], Awaitable[dict[str, Any]]]


class PayloadTooLarge(Exception):
    pass


class SandboxGone(Exception):
    """The request names no live sandbox: answered as E2B's edge answers it (502, "... was not
    found"), which the SDK reads as a sandbox that is not running."""


@web.middleware
async def unknown_sandbox(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except SandboxGone as gone:
        return web.json_response({"code": 502, "message": str(gone)}, status=502)


def _sandbox(request: web.Request) -> Sandbox:
    sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
    try:
        sandbox = request.app[REGISTRY_KEY].get(sandbox_id)
    except ApiError:
        raise SandboxGone(f"The sandbox {sandbox_id} was not found") from None
    token = request.headers.get("X-Access-Token", "")
    if not hmac.compare_digest(token.encode(), sandbox.access_token.encode()):
        raise ConnectError("unauthenticated", "invalid access token for this sandbox")
    return sandbox


def _basic_user(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if not header.startswith("Basic "):
        return None
    try:
        decoded = base64.b64decode(header[6:]).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError("invalid_argument", "bad Basic authorization header") from None
    return decoded.split(":", 1)[0] or None


# --- process.Process -----------------------------------------------------------------------


def _config(message: dict[str, Any]) -> ProcessConfig:
    raw = message.get("process") or {}
    cmd = raw.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise ConnectError("invalid_argument", "process.cmd is required")
    args = raw.get("args") or []
    envs = raw.get("envs") or {}
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConnectError("invalid_argument", "process.args must be strings")
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise ConnectError("invalid_argument", "process.envs must map strings to strings")
    cwd = raw.get("cwd")
    return ProcessConfig(cmd, list(args), dict(envs), cwd if isinstance(cwd, str) else None)


async def _stream(
    request: web.Request,
    first: dict[str, Any],
    process: Process,
    start: int,
    deadline: float | None,
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": STREAM_CONTENT_TYPE})
    await response.prepare(request)
    keepalive = float(request.headers.get("Keepalive-Ping-Interval", DEFAULT_KEEPALIVE_S) or 50)
    error: ConnectError | None = None
    try:
        # Each batch of events goes out in one write, and the last one with the end of the
        # stream: a quick command's output, end and end-of-stream cost one send, not three.
        await response.write(envelope({"event": first}))
        pending = b""
        async for batch in process.follow(start, keepalive):
            if deadline is not None and time.monotonic() >= deadline:
                break
            data = b"".join(envelope({"event": event}) for event in batch)
            if process.ended:  # the last batch: it goes with the end of the stream
                pending += data
            else:
                await response.write(data)
        error = process.error
        if deadline is not None and time.monotonic() >= deadline and error is None:
            if not process.events or "end" not in process.events[-1]:
                error = ConnectError("deadline_exceeded", "the stream's timeout passed")
        await response.write_eof(pending + end_of_stream(error))
    except (ConnectionResetError, ConnectionError):
        # The client went away (disconnect): the process runs on, as on E2B.
        pass
    return response


async def process_start(request: web.Request) -> web.StreamResponse:
    sandbox = _sandbox(request)
    message = unwrap_envelope(await request.read())
    if message.get("pty"):
        raise ConnectError("unimplemented", "process.Process/Start with a pty is not implemented")
    config = _config(message)
    limit = timeout_s(request)
    tag = message.get("tag") if isinstance(message.get("tag"), str) else None
    process = sandbox.processes.start(
        config,
        tag=tag,
        stdin=bool(message.get("stdin")),
        user=_basic_user(request),
        env=sandbox.env_vars,
        timeout_s=limit,
    )
    first = {"start": {"pid": process.pid}}
    return await _stream(request, first, process, 0, None)


async def process_connect(request: web.Request) -> web.StreamResponse:
    sandbox = _sandbox(request)
    message = unwrap_envelope(await request.read())
    process = sandbox.processes.find(message.get("process") or {})
    limit = timeout_s(request)
    deadline = time.monotonic() + limit if limit else None
    first = {"start": {"pid": process.pid}}
    return await _stream(request, first, process, len(process.events), deadline)


async def process_list(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    return {"processes": [p.info() for p in sandbox.processes.running.values() if not p.ended]}


async def process_send_input(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    process = sandbox.processes.find(message.get("process") or {})
    data = (message.get("input") or {}).get("stdin")
    if not isinstance(data, str):
        raise ConnectError("invalid_argument", "input.stdin (base64 bytes) is required")
    try:
        raw = base64.b64decode(data)
    except binascii.Error:
        raise ConnectError("invalid_argument", "input.stdin is not base64") from None
    await sandbox.processes.send_stdin(process, raw)
    return {}


async def process_close_stdin(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    process = sandbox.processes.find(message.get("process") or {})
    await sandbox.processes.send_stdin(process, b"", close=True)
    return {}


async def process_send_signal(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    process = sandbox.processes.find(message.get("process") or {})
    await sandbox.processes.signal(process, str(message.get("signal", "")))
    return {}


# --- filesystem.Filesystem -----------------------------------------------------------------


def _path(message: dict[str, Any], key: str = "path") -> str:
    value = message.get(key)
    if not isinstance(value, str) or not value:
        raise ConnectError("invalid_argument", f"{key} is required")
    return value


async def fs_stat(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    return {"entry": await files.stat(sandbox.target, _path(message))}


async def fs_list_dir(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    depth = int(message.get("depth") or 1)
    return {"entries": await files.list_dir(sandbox.target, _path(message), depth)}


async def fs_make_dir(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    return {"entry": await files.make_dir(sandbox.target, _path(message), user)}


async def fs_move(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    source, destination = _path(message, "source"), _path(message, "destination")
    return {"entry": await files.move(sandbox.target, source, destination)}


async def fs_remove(sandbox: Sandbox, message: dict[str, Any], user: str | None) -> dict:
    await files.remove(sandbox.target, _path(message))
    return {}


UNARY: dict[str, Unary] = {
    "process.Process/List": process_list,
    "process.Process/SendInput": process_send_input,
    "process.Process/CloseStdin": process_close_stdin,
    "process.Process/SendSignal": process_send_signal,
    "filesystem.Filesystem/Stat": fs_stat,
    "filesystem.Filesystem/ListDir": fs_list_dir,
    "filesystem.Filesystem/MakeDir": fs_make_dir,
    "filesystem.Filesystem/Move": fs_move,
    "filesystem.Filesystem/Remove": fs_remove,
}
STREAMS = {"process.Process/Start": process_start, "process.Process/Connect": process_connect}


async def rpc(request: web.Request) -> web.StreamResponse:
    method = f"{request.match_info['service']}/{request.match_info['method']}"
    streaming = request.content_type == STREAM_CONTENT_TYPE
    try:
        if method in STREAMS:
            return await STREAMS[method](request)
        if method not in UNARY:
            raise ConnectError("unimplemented", f"{method} is not implemented by swerl's E2B face")
        sandbox = _sandbox(request)
        message = parse_json(await request.read())
        result = await UNARY[method](sandbox, message, _basic_user(request))
        return web.json_response(result)
    except ConnectError as error:
        if streaming:
            # A stream's error travels in its end-of-stream message, under HTTP 200.
            return web.Response(
                body=end_of_stream(error), headers={"Content-Type": STREAM_CONTENT_TYPE}
            )
        return unary_error(error)


# --- /files ------------------------------------------------------------------------------


_FILE_ERROR_STATUS = {
    "not_found": 404,
    "invalid_argument": 400,
    "unauthenticated": 401,
    "already_exists": 409,
    "unavailable": 502,
}


def _file_error(error: ConnectError) -> web.Response:
    status = _FILE_ERROR_STATUS.get(error.code, 500)
    return web.json_response({"code": status, "message": error.message}, status=status)


async def _limited(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise PayloadTooLarge()
        yield chunk


async def files_get(request: web.Request) -> web.StreamResponse:
    try:
        sandbox = _sandbox(request)
        path = request.query.get("path", "")
        if not path:
            raise ConnectError("invalid_argument", "path is required")
        size = await files.file_size(sandbox.target, path)
    except ConnectError as error:
        return _file_error(error)
    # The body is chunked, not sized up front: the file may shrink or be rewritten between
    # its stat and its last segment, and a Content-Length the body then falls short of leaves
    # the client waiting for bytes that never come.
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    with contextlib.suppress(ConnectionResetError, ConnectionError):
        async for chunk in files.read(sandbox.target, path, size):
            await response.write(chunk)
        await response.write_eof()
    return response


async def files_post(request: web.Request) -> web.StreamResponse:
    limit = request.app[MAX_FILE_KEY]
    too_large = f"the file is larger than this server's limit of {limit} bytes (max_file_bytes)"
    try:
        sandbox = _sandbox(request)
        user = request.query.get("username") or None
        if request.content_length is not None and request.content_length > limit:
            return web.json_response({"code": 413, "message": too_large}, status=413)
        written = []
        if request.content_type == "multipart/form-data":
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader) or part.name != "file":
                    continue
                path = request.query.get("path") or part.filename or ""
                if not path:
                    raise ConnectError("invalid_argument", "path is required")
                body = _limited(_part_chunks(part), limit)
                written.append(await files.write(sandbox.target, path, user, body))
        else:
            path = request.query.get("path", "")
            if not path:
                raise ConnectError("invalid_argument", "path is required")
            body = _limited(request.content.iter_chunked(1 << 20), limit)
            written.append(await files.write(sandbox.target, path, user, body))
    except ConnectError as error:
        return _file_error(error)
    except PayloadTooLarge:
        return web.json_response({"code": 413, "message": too_large}, status=413)
    return web.json_response(written)


async def _part_chunks(part: Any) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(1 << 20):
        yield chunk


async def health(request: web.Request) -> web.Response:
    sandbox_id = request.headers.get("E2b-Sandbox-Id", "")
    try:
        request.app[REGISTRY_KEY].get(sandbox_id)
    except ApiError:
        raise SandboxGone(f"The sandbox {sandbox_id} was not found") from None
    return web.Response(status=204)


def make_envd_app(registry: SandboxRegistry, *, max_file_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_file_bytes + (1 << 20), middlewares=[unknown_sandbox])
    app[REGISTRY_KEY] = registry
    app[MAX_FILE_KEY] = max_file_bytes
    app.router.add_get("/health", health)
    app.router.add_get("/files", files_get)
    app.router.add_post("/files", files_post)
    app.router.add_post("/{service}/{method}", rpc)
    return app
