"""The inspector shows a `tool_calls` episode as it shows a bash-block one: each turn's calls as
its action and the tool messages that answered them as its output, from traj.json as the agent
writes it (OpenAI message shape)."""

from __future__ import annotations

import html
import json
from urllib.request import urlopen

import pytest
from testkit.web import Served


@pytest.fixture(scope="module")
def inspector(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    folder = run / "t__tools"
    folder.mkdir()
    meta = {
        "episode_id": "tools",
        "instance_id": "t",
        "status": "SUBMITTED",
        "reward": 1.0,
        "metrics": {"turns": 2, "tool_calls": 3},
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    call = {"id": "call_1", "type": "function"}
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "p"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {**call, "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "python", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "bash", "content": "README.md"},
        {"role": "tool", "tool_call_id": "call_2", "name": "python", "content": "Error: unknown"},
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "tool_call_id": "call_3", "name": "submit", "content": "Submitted."},
    ]
    steps = [
        {
            "turn": 0,
            "response": "Looking.",
            "format_error": True,
            "tool_calls": [{"id": "call_1", "name": "bash", "command": "ls", "exit_code": 0}],
        },
        {
            "turn": 1,
            "response": "",
            "format_error": False,
            "tool_calls": [{"id": "call_3", "name": "submit", "command": "submit"}],
        },
    ]
    (folder / "traj.json").write_text(json.dumps({"messages": messages, "steps": steps}))
    served = Served("inspect", str(run), "--port", "0", "--tokenizer", "")
    yield served
    served.stop()


def test_tool_calls_show_as_the_turns_action_and_tool_messages_as_its_output(inspector):
    with urlopen(f"{inspector.url}/episode/t__tools", timeout=30) as response:
        page = html.unescape(response.read().decode())
    assert "bash: ls" in page and "submit: submit" in page
    assert "[bash call_1]\nREADME.md" in page
    assert "[python call_2]\nError: unknown" in page
    assert "[submit call_3]\nSubmitted." in page
