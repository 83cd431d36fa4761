"""The agent protocol (mini-swe-agent style): one ```bash block per reply, observations, and
the submission sentinel."""

from __future__ import annotations

import re
from dataclasses import dataclass

from swerl.agent.config import SUBMIT_SENTINEL, AgentConfig

# A fenced block opened by ```bash on its own line and closed by ``` at the start of a line.
_BASH_BLOCK = re.compile(r"```bash[ \t]*\r?\n(.*?)\r?\n?```", re.DOTALL)
_THINK_END = "</think>"


@dataclass(frozen=True)
class Action:
    command: str | None  # None: a format error
    n_blocks: int


def parse_action(response_text: str) -> Action:
    """The one bash command of a reply; reasoning inside <think>...</think> is not searched."""
    visible = response_text.rsplit(_THINK_END, 1)[-1]
    blocks = _BASH_BLOCK.findall(visible)
    if len(blocks) != 1 or not blocks[0].strip():
        return Action(None, len(blocks))
    return Action(blocks[0].strip(), 1)


def submission(output: str, exit_code: int) -> str | None:
    """The submitted patch when the output's first line is the sentinel and the command
    exited 0; None otherwise."""
    if exit_code != 0:
        return None
    lines = output.lstrip().splitlines(keepends=True)
    if not lines or lines[0].strip() != SUBMIT_SENTINEL:
        return None
    return "".join(lines[1:])


def render_observation(
    config: AgentConfig,
    *,
    exit_code: int,
    output: str,
    timed_out: bool,
    timeout_s: float,
    turns_left: int | None,
) -> str:
    return config.render(
        "observation_template",
        returncode=exit_code,
        output=output,
        timed_out=timed_out,
        timeout_s=timeout_s,
        turns_left=turns_left,
    )


def render_format_error(config: AgentConfig, *, n_blocks: int, turns_left: int | None) -> str:
    return config.render("format_error_template", n_blocks=n_blocks, turns_left=turns_left)
