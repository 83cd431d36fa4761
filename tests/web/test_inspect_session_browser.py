"""`swerl inspect` shows a gateway session's call tree, in a real headless chromium: a session of
a real agent (gRPC OpenSession/CloseSession, its gateway port) driven by the `openai` SDK against
the replay policy with the real Qwen3 tokenizer, written by CloseSession into an artifact dir."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import openai
import pytest
from google.protobuf import struct_pb2
from selenium.webdriver.common.by import By
from testkit.gateway import BASH_TOOL, KEY, SCRIPT, TOKENIZER
from testkit.web import Served, console_errors, save_screenshot

from swerl.agent.server import AgentServer
from swerl.agent.settings import AgentSettings
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.client import error_info, make_channel
from swerl.devservers.replay import ReplayPolicyServer

TOKEN = "inspect-session-token"


class NoSandboxes:
    def lease(self, *args, **kwargs):
        raise AssertionError("sessions lease no sandbox")


def _open(url: str, artifact_dir: str, owner: str) -> pb.OpenSessionRequest:
    params = struct_pb2.Struct()
    params.update({"temperature": 1.0, "max_new_tokens": 256})
    return pb.OpenSessionRequest(
        policy=pb.PolicyConfig(endpoint=url, tokenizer_path=TOKENIZER, sampling_params=params),
        owner=owner,
        artifact_dir=artifact_dir,
    )


async def _session(run_dir: Path) -> tuple[pb.CloseSessionResponse, list]:
    """Root, extend, a fork (history rewritten after the first reply) and a second root (a
    sub-agent's own conversation), then CloseSession with a reward."""
    replay = ReplayPolicyServer({KEY: SCRIPT}, keep_requests=True)
    url = await replay.start()
    settings = AgentSettings(
        host="127.0.0.1",
        port=0,
        auth_token=TOKEN,
        log_level="warning",
        tokenizer_processes=0,
        gateway_port=0,
    )
    agent = AgentServer(settings, provider=NoSandboxes())  # type: ignore[arg-type]
    await agent.start()
    channel = make_channel(agent.address, token=TOKEN)
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    try:
        # A relative artifact_dir is refused (it would land wherever the agent runs).
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.OpenSession(_open(url, "runs/x", "r"), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(err.value)[0] == "INVALID_SESSION_SPEC"
        opened = await stub.OpenSession(_open(url, str(run_dir), "rollout-9"), timeout=30)
        async with openai.AsyncOpenAI(
            base_url=opened.openai_base_url, api_key=opened.secret
        ) as client:

            async def ask(messages: list) -> dict:
                reply = await client.chat.completions.create(
                    model="m", messages=messages, tools=[BASH_TOOL]
                )
                return reply.choices[0].message.model_dump(exclude_none=True)

            task = [{"role": "user", "content": f"{KEY}: fix it"}]
            first = await ask(task)
            result = {
                "role": "tool",
                "tool_call_id": first["tool_calls"][0]["id"],
                "content": "a.py",
            }
            await ask([*task, first, result])
            # The harness compacts: the same first reply, then a different tool result.
            other = {**result, "content": "a.py b.py (listing again)"}
            await ask([*task, first, other])
            await ask([{"role": "user", "content": f"{KEY}: sub-agent, read a.py"}])
        closed = await stub.CloseSession(
            pb.CloseSessionRequest(session_id=opened.session_id, reward=1.0), timeout=30
        )
        return closed, list(replay.stats.requests_seen)
    finally:
        await channel.close()
        await agent.stop(0)
        await replay.stop()


@pytest.fixture(scope="module")
def session_run(tmp_path_factory) -> tuple[Path, pb.CloseSessionResponse, list]:
    run_dir = tmp_path_factory.mktemp("sessions")
    closed, seen = asyncio.run(_session(run_dir))
    return run_dir, closed, seen


def test_close_session_writes_the_tree_and_the_chains(session_run) -> None:
    run_dir, closed, seen = session_run
    folder = run_dir / f"rollout-9__{closed.session_id}"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["kind"] == "gateway-session" and meta["status"] == "CLOSED"
    assert meta["reward"] == 1.0 and meta["instance_id"] == "rollout-9"
    tree = json.loads((folder / "session.json").read_text())
    kinds = [c["kind"] for c in tree["calls"]]
    assert kinds == [
        "SESSION_CALL_KIND_ROOT",
        "SESSION_CALL_KIND_EXTEND",
        "SESSION_CALL_KIND_FORK",
        "SESSION_CALL_KIND_ROOT",
    ]
    assert [c.get("parent_call_index") for c in tree["calls"]] == [None, 0, 0, None]
    chains = json.loads((folder / "tokens.json").read_text())["chains"]
    assert len(chains) == len(closed.records) == 3
    for chain, record in zip(chains, closed.records, strict=True):
        assert chain["prompt_ids"] == list(record.prompt_ids)
        assert chain["response_ids"] == list(record.response_ids)
        assert chain["loss_mask"] == list(record.loss_mask)
    # The fork's chain: the first call's ids as /generate got and returned them, then the
    # rewritten tool result and the third call's sampled ids.
    sent, got = seen[2]
    assert chains[1]["prompt_ids"] + chains[1]["response_ids"] == sent + got


def test_inspector_shows_the_session_tree_with_its_fork_and_chains(
    session_run, browser, screenshots
) -> None:
    run_dir, closed, _ = session_run
    served = Served("inspect", str(run_dir), "--port", "0")
    try:
        browser.get(served.url + "/")
        rows = browser.find_elements(By.CSS_SELECTOR, "#episodes tr.episode")
        assert len(rows) == 1
        cells = [td.text for td in rows[0].find_elements(By.TAG_NAME, "td")]
        assert (
            cells[0].splitlines() == ["rollout-9", closed.session_id]
            and cells[1] == "CLOSED"
            and float(cells[2]) == 1.0
        )
        key = rows[0].get_attribute("data-key")
        browser.get(f"{served.url}/episode/{key}")
        calls = browser.find_elements(By.CSS_SELECTOR, "#session-tree .call")
        # Depth-first: the first chain (0 -> 1), the fork from call 0, then the second root.
        shown = [
            (
                c.get_attribute("data-call"),
                c.get_attribute("data-kind"),
                c.get_attribute("data-depth"),
            )
            for c in calls
        ]
        assert shown == [
            ("0", "root", "0"),
            ("1", "extend", "0"),
            ("2", "fork", "1"),
            ("3", "root", "0"),
        ]
        fork = browser.find_element(By.ID, "call-2")
        assert fork.get_attribute("data-parent") == "0"
        why = fork.find_element(By.CSS_SELECTOR, ".why").text
        assert "fork at call 0" in why and "already continued by call 1" in why
        assert "kept the first 2 message(s)" in why
        assert "new root" in browser.find_element(By.CSS_SELECTOR, "#call-3 .why").text
        ends = {
            e.get_attribute("data-chain"): e.find_element(By.XPATH, "..").get_attribute("data-call")
            for e in browser.find_elements(By.CSS_SELECTOR, ".chain-end")
        }
        assert ends == {"0": "1", "1": "2", "2": "3"}
        assert browser.find_element(By.ID, "session-chains").text == "3"
        # A session has no problem statement or turns of an episode.
        assert not browser.find_elements(By.ID, "turns")
        save_screenshot(browser, screenshots / "inspect-session-tree.png")
        assert console_errors(browser) == []
        browser.find_element(By.ID, "token-view").click()
        titles = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "section.record h2")]
        assert titles == [
            "Chain 0 (trained as one sample; ends at call 1)",
            "Chain 1 (trained as one sample; ends at call 2)",
            "Chain 2 (trained as one sample; ends at call 3)",
        ]
        trained = browser.find_elements(By.CSS_SELECTOR, ".tokens.response .tok[data-mask='1']")
        assert len(trained) == sum(sum(r.loss_mask) for r in closed.records)
        assert not browser.find_elements(By.CSS_SELECTOR, ".trim-marker")
        save_screenshot(browser, screenshots / "inspect-session-tokens.png")
        assert console_errors(browser) == []
    finally:
        served.stop()
