"""The model gateway in front of the replay policy (real HTTP, the real Qwen3 tokenizer and chat
template), for the real-client tests."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from swerl.agent.gateway.service import Gateway, local_gateway
from swerl.agent.gateway.session import Session, SessionSpec
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.devservers.replay import ReplayPolicyServer

TOKENIZER = str(bundled_qwen3_tokenizer_dir())
KEY = "GATEWAY-TASK-7"

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
ANTHROPIC_BASH_TOOL = {
    "name": "bash",
    "description": "Run a bash command",
    "input_schema": BASH_TOOL["function"]["parameters"],
}


def tool_turn(command: str, thought: str = "Let me look around.") -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<think>\n{thought}\n</think>\n\nRunning it.\n<tool_call>\n{call}\n</tool_call>"


SCRIPT = [tool_turn("ls"), tool_turn("cat a.py", "Now read the file."), "All done: a.py is fine."]


@dataclass
class GatewayEnv:
    gateway: Gateway
    replay: ReplayPolicyServer
    policy_url: str

    async def open(self, **spec: Any) -> Session:
        values: dict[str, Any] = {"endpoint": self.policy_url, "tokenizer_path": TOKENIZER}
        values.update(spec)
        return await self.gateway.store.open(SessionSpec(**values))

    def openai_url(self, session: Session) -> str:
        return self.gateway.openai_base_url(session)

    def anthropic_url(self, session: Session) -> str:
        return self.gateway.anthropic_base_url(session)


@contextlib.asynccontextmanager
async def gateway_env(
    scripts: dict[str, list[str]] | None = None,
    *,
    gateway_options: dict[str, Any] | None = None,
    **replay_options: Any,
) -> AsyncIterator[GatewayEnv]:
    replay = ReplayPolicyServer(
        {KEY: SCRIPT} if scripts is None else scripts, keep_requests=True, **replay_options
    )
    url = await replay.start()
    try:
        async with local_gateway(**(gateway_options or {})) as gateway:
            yield GatewayEnv(gateway, replay, url)
    finally:
        while _CLIENTS:
            await _CLIENTS.pop().close()
        await replay.stop()


_CLIENTS: list[Any] = []


def async_client(**options: Any) -> Any:
    """An AsyncOpenAI client closed when its gateway_env ends (so no transport outlives the
    test's event loop)."""
    import openai

    client = openai.AsyncOpenAI(**options)
    _CLIENTS.append(client)
    return client


def assert_chains_exact(records: list[Any], replay: ReplayPolicyServer) -> None:
    """Every chain is some /generate request's input_ids plus what it returned (its last call),
    and every sent request is inside a chain; mask 1 only on sampled ids."""
    sent = [(list(i), list(o)) for i, o in replay.stats.requests_seen]
    for record in records:
        tokens = list(record.prompt_ids) + list(record.response_ids)
        assert any(tokens == i + o for i, o in sent), "a chain is no request + its reply"
        assert len(record.loss_mask) == len(record.response_ids) == len(record.logprobs)
    for i, o in sent:
        if not o or o == []:
            continue
        assert any(
            (list(r.prompt_ids) + list(r.response_ids))[: len(i) + len(o)] == i + o for r in records
        ), "a request is in no chain"
