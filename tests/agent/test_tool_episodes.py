"""Episodes of the `tools` config on the real stack: real dockerd, pool and exec node, the replay
policy speaking Qwen3's tool calls through the real tokenizer and template."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import pytest
from testkit.agent import agent_stack, bundled_tasks, check_record, result_of, run_to_result
from testkit.agent import start_for as bash_start_for

from swerl.agent.actions.toolcalls import get_tool_call_format
from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import (
    ReplayPolicyServer,
    gold_tool_script,
    script_key,
)

pytestmark = pytest.mark.usefixtures("base_image")
QWEN = get_tool_call_format("qwen25")


def start_for(task, url, episode_id, **kwargs) -> pb.EpisodeStart:
    start = bash_start_for(task, url, episode_id, **kwargs)
    start.options.config_name = "tools"
    return start


async def _run(turns_by_key, episode_id, *, garbage=False, **start_kwargs):
    task = bundled_tasks()[0]
    scripts = {} if garbage else {script_key(task.instance["problem_statement"]): turns_by_key}
    replay = ReplayPolicyServer(scripts, garbage=garbage, keep_requests=True)
    url = await replay.start()
    try:
        async with agent_stack() as env:
            messages = await run_to_result(
                env.stub, start_for(task, url, episode_id, **start_kwargs)
            )
    finally:
        await replay.stop()
    return task, messages, replay


def _read_traj(out: str) -> str:
    return next(Path(out).glob("*/traj.json")).read_text()


async def test_gold_tool_call_episode_resolves_with_tool_messages_in_its_trajectory():
    task = bundled_tasks()[0]
    with tempfile.TemporaryDirectory() as out:
        _, messages, replay = await _run(
            gold_tool_script(task.gold_patch), "tools-gold", artifact_dir=out
        )
        result = result_of(messages)
        assert result.status == pb.EPISODE_STATUS_SUBMITTED, result.error_message
        assert result.reward == 1.0
        turns = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
        # Two calls in the first reply, the editor then bash in the second.
        assert turns[0].action.splitlines() == [
            "git status --short && ls",
            "str_replace_editor view /testbed",
        ]
        assert turns[1].action.splitlines()[0] == "str_replace_editor create /tmp/swerl_fix.patch"
        assert not any(t.format_error for t in turns) and turns[-1].submitted
        metrics = dict(result.metrics)
        assert metrics["tool_calls"] == 6.0
        assert metrics["tool_calls_bash"] == 3.0
        assert metrics["tool_calls_str_replace_editor"] == 2.0
        assert metrics["tool_calls_submit"] == 1.0
        assert metrics["tool_parse_failures"] == 0.0
        check_record(result.trajectory, replay)
        # The policy was sent the tools in its system prompt and each result as a tool response.
        first = replay.tokenizer.decode(replay.stats.requests_seen[0][0])
        assert '"name": "str_replace_editor"' in first and "<tools>" in first
        last = replay.tokenizer.decode(replay.stats.requests_seen[-1][0])
        assert last.count("<tool_response>") == 5
        traj = json.loads(await asyncio.to_thread(_read_traj, out))
    roles = [m["role"] for m in traj["messages"]]
    assert roles[:5] == ["system", "user", "assistant", "tool", "tool"]
    call = traj["messages"][2]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "git status --short && ls"}
    assert traj["messages"][3]["tool_call_id"] == call["id"]
    assert traj["steps"][0]["tool_calls"][0]["name"] == "bash"


async def test_bad_calls_are_tool_errors_the_model_reads_and_count_as_format_errors():
    turns = [
        # Malformed JSON, an unknown tool, a missing argument: three tool errors, nothing runs.
        'Trying.\n<tool_call>\n{"name": "bash", "arguments": {"command": \n</tool_call>\n'
        + QWEN.render_call("python", {"code": "1"})
        + "\n"
        + QWEN.render_call("str_replace_editor", {"command": "view"}),
        "<think>\nI could call <tool_call>{}</tool_call> here.\n</think>\n\nJust talking.",
        QWEN.render_call("submit", {}),
    ]
    _, messages, replay = await _run(turns, "tools-bad")
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_SUBMITTED, result.error_message
    steps = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    assert [t.format_error for t in steps] == [True, True, False]
    assert dict(result.metrics)["tool_parse_failures"] == 4.0
    assert dict(result.metrics)["format_errors"] == 2.0
    second = replay.tokenizer.decode(replay.stats.requests_seen[1][0])
    assert "Error: malformed tool call: invalid JSON" in second
    assert "Error: unknown tool 'python' (tools: bash, str_replace_editor, submit)" in second
    assert "Error: str_replace_editor: missing required argument(s): path" in second
    third = replay.tokenizer.decode(replay.stats.requests_seen[2][0])
    assert "Your reply called no tool" in third
    assert "It wrote 1 tool call inside its reasoning" in third


async def test_garbage_ends_on_the_format_error_limit_not_infra_error():
    _, messages, _ = await _run([], "tools-garbage", garbage=True, max_turns=20)
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_LIMIT_TURNS, result.error_message
    assert result.error_reason == "LIMIT_FORMAT_ERRORS"
    turns = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    assert len(turns) == 5 and all(t.format_error for t in turns)
    check_record(result.trajectory)
