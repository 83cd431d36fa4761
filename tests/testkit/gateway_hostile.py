"""Helpers of the gateway's hostile-input tests: raw calls, and the check that no input made
the gateway log an unexpected failure (`gateway.call_failed`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
from structlog.testing import capture_logs


@contextlib.contextmanager
def no_call_failed() -> Iterator[list[dict[str, Any]]]:
    """The log lines written inside; fails when one is `gateway.call_failed`."""
    with capture_logs() as logs:
        yield logs
    failed = [line for line in logs if line.get("event") == "gateway.call_failed"]
    assert not failed, f"the gateway failed unexpectedly: {failed}"


async def post_raw(
    url: str, secret: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POST raw bytes (what an SDK cannot send); the status and the decoded JSON answer."""
    sent = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    sent.update(headers or {})
    async with aiohttp.ClientSession() as http, http.post(url, data=body, headers=sent) as reply:
        text = await reply.text()
        return reply.status, json.loads(text) if text else None
