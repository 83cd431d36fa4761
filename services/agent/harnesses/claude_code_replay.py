"""Replay scripts that play the bundled tasks through Claude Code's own tools (`Bash`, `Write`),
as the policy writes tool calls (Qwen3's Hermes-style <tool_call> JSON, which the gateway's
Anthropic face answers as `tool_use` blocks). A reply without a call ends the CLI's run; the
sandbox's diff is graded."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from swerl.agent.replay import script_key
from swerl.agent.toolcalls import get_tool_call_format

# Where the scripts write their patch (outside the repository, so the diff is the fix alone).
PATCH_PATH = "/tmp/swerl_fix.patch"


def _reply(text: str, name: str, arguments: dict[str, Any]) -> str:
    return text + "\n" + get_tool_call_format("qwen25").render_call(name, arguments)


def _bash(text: str, command: str, description: str) -> str:
    return _reply(text, "Bash", {"command": command, "description": description})


def _apply(patch: str, why: str) -> list[str]:
    return [
        _reply(why, "Write", {"file_path": PATCH_PATH, "content": patch}),
        _bash("Applying it.", f"git apply {PATCH_PATH} && git diff --stat", "Apply the patch"),
    ]


def gold_script(patch: str) -> list[str]:
    """Look around, write the fix with Write, apply it with Bash, run the tests, stop."""
    return [
        _bash("Let me look at the repository first.", "git status --short && ls", "Look around"),
        *_apply(patch, "I found the bug; writing the fix as a patch."),
        _bash("Now run the test suite.", "python3 -m pytest -q 2>&1 | tail -n 5", "Run tests"),
        "The fix is in place and the tests pass.",
    ]


def wrong_script(wrong_patch: str | None) -> list[str]:
    """A change that does not fix: the task's known-wrong patch, or an unrelated edit."""
    if wrong_patch:
        change = _apply(wrong_patch, "I think this is the fix.")
    else:
        change = [
            _bash(
                "I think a note in the README is what is needed.",
                "echo '# see the issue tracker' >> README.md && git diff --stat",
                "Edit the README",
            )
        ]
    return [_bash("Looking around.", "ls", "List files"), *change, "Done."]


def claude_code_scripts(tasks: Iterable[Any], variant: str = "gold") -> dict[str, list[str]]:
    """Scripts for `swerl.tasks.TaskInstance`s by their key (see `replay.script_key`)."""
    scripts = {}
    for task in tasks:
        key = script_key(task.instance["problem_statement"])
        if variant == "gold":
            scripts[key] = gold_script(task.gold_patch)
        elif variant == "wrong":
            scripts[key] = wrong_script(task.wrong_patch)
        else:
            raise ValueError(f"no claude-code script variant {variant!r}")
    return scripts
