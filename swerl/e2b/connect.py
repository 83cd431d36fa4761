"""The server side of the Connect protocol as E2B's envd speaks it: JSON codec, no compression.

A unary call is a POST of a JSON body answered with a JSON body (or a JSON error body with the
HTTP status of its code). A server-streaming call sends one enveloped message (a flags byte, a
4-byte big-endian length, the JSON) and is answered with enveloped messages and a final
end-of-stream envelope (flags 0x02) that carries the error, if any.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from aiohttp import web

END_STREAM_FLAG = 0x02
STREAM_CONTENT_TYPE = "application/connect+json"

# The HTTP status of each Connect code on a unary call's error (the protocol's own table).
HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    """A call's failure as a Connect code ("not_found", ...) and a message for the caller."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def body(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_of_stream(error: ConnectError | None = None) -> bytes:
    return envelope({"error": error.body()} if error is not None else {}, END_STREAM_FLAG)


def unwrap_envelope(body: bytes) -> dict[str, Any]:
    """The one message of a server-streaming request's body."""
    if len(body) < 5:
        raise ConnectError("invalid_argument", "the request has no enveloped message")
    flags, length = struct.unpack(">BI", body[:5])
    if flags & 0x01:
        raise ConnectError("internal", "compressed messages are not supported")
    return parse_json(body[5 : 5 + length])


def parse_json(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data or b"{}")
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"the request is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the request is not a JSON object")
    return message


def unary_error(error: ConnectError) -> web.Response:
    return web.json_response(error.body(), status=HTTP_STATUS.get(error.code, 500))


def timeout_s(request: web.Request) -> float | None:
    """The call's deadline from its `connect-timeout-ms` header, in seconds (None: none)."""
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return None
    try:
        millis = int(raw)
    except ValueError:
        raise ConnectError("invalid_argument", f"bad connect-timeout-ms {raw!r}") from None
    return millis / 1000 if millis > 0 else None
