"""Helpers of the gateway's hostile-input tests: raw calls, one OpenAI SDK client on a fresh
session, and the check that no input made the gateway log an unexpected failure
(`gateway.call_failed`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
from structlog.testing import capture_logs

from testkit.gateway import GatewayEnv, gateway_env


@contextlib.contextmanager
def no_call_failed() -> Iterator[list[dict[str, Any]]]:
    """The log lines written inside; fails when one is `gateway.call_failed`."""
    with capture_logs() as logs:
        yield logs
    failed = [line for line in logs if line.get("event") == "gateway.call_failed"]
    assert not failed, f"the gateway failed unexpectedly: {failed}"


@contextlib.asynccontextmanager
async def openai_session(
    **session: Any,
) -> AsyncIterator[tuple[GatewayEnv, Any, openai.AsyncOpenAI]]:
    """A gateway in front of the replay, one session opened with `session`'s options and the
    real OpenAI SDK on it (no retries), all inside `no_call_failed`."""
    with no_call_failed():
        async with gateway_env() as env:
            opened = await env.open(**session)
            async with openai.AsyncOpenAI(
                base_url=env.openai_url(opened), api_key=opened.secret, max_retries=0
            ) as client:
                yield env, opened, client


async def post_raw(
    url: str, secret: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POST raw bytes (what an SDK cannot send); the status and the decoded JSON answer."""
    sent = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    sent.update(headers or {})
    async with aiohttp.ClientSession() as http, http.post(url, data=body, headers=sent) as reply:
        text = await reply.text()
        return reply.status, json.loads(text) if text else None
