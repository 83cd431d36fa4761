"""The bash-block action protocol (mini-swe-agent style): one ```bash block per reply, its
observation, the submission sentinel, and `BashBlockActions`, the protocol as the loop runs it."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from swerl.agent.actions.base import OUTPUT_HEAD_CHARS, Acted, ActionTurn, RunCpu, SandboxBroken
from swerl.agent.actions.tool_set import command_notes, killed_by
from swerl.agent.config import SUBMIT_SENTINEL, AgentConfig
from swerl.agent.errors import EpisodeInfraError
from swerl.agent.loop.sandbox import SANDBOX_NOT_RUNNING
from swerl.agent.spec import EpisodeSpec
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.timeconv import duration_pb

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


class BashBlockActions:
    """The bash-block protocol as the loop runs it: the reply's one command runs in the sandbox
    and its output (or a format error) comes back as a user message."""

    name = "bash"

    def __init__(self, spec: EpisodeSpec, cpu: RunCpu[str]) -> None:
        self._spec = spec
        self._cpu = cpu
        # The policy's last command ended killed by a signal: a sandbox found dead after it is
        # the policy's doing.
        self.last_killed = False

    async def act(self, turn: ActionTurn) -> Acted:
        """Carries out the action in the reply (its one bash block)."""
        text = turn.answer.text
        turn.messages.append({"role": "assistant", "content": text})
        action = parse_action(text)
        step: dict[str, Any] = {"turn": turn.index, "response": text}
        turn.steps.append(step)
        if action.command is None:
            observation = render_format_error(
                self._spec.config, n_blocks=action.n_blocks, turns_left=turn.turns_left
            )
            turn.messages.append({"role": "user", "content": observation})
            step.update(format_error=True, n_blocks=action.n_blocks)
            return Acted(pb.EpisodeTurn(format_error=True), observation, None, 0, 0.0, None, 0, "")
        return await self._command(turn, step, action.command)

    async def _command(self, turn: ActionTurn, step: dict[str, Any], command: str) -> Acted:
        """Runs one command of the policy in its sandbox: the turn, its step record and its
        observation (or the submission, when the command submitted)."""
        spec, config = self._spec, self._spec.config
        env = {**config.env, **spec.env}
        started = time.monotonic()
        try:
            result = await turn.sandbox.run(
                command, timeout_s=spec.command_timeout_s, env=env, cwd=config.workdir
            )
        except EpisodeInfraError as err:
            step.update(action=command, sandbox_lost=err.message[:500])
            if err.reason == SANDBOX_NOT_RUNNING and self.last_killed:
                raise SandboxBroken(err.message) from err
            raise
        exec_s = time.monotonic() - started
        output = result.output.decode(errors="replace")
        submitted = submission(output, result.exit_code)
        signum = killed_by(result.exit_code, result.timed_out)
        restarted = bool(getattr(result, "sandbox_restarted", False))
        self.last_killed = signum is not None
        step.update(
            action=command,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            exec_s=round(exec_s, 4),
            output_bytes=len(result.output),
        )
        if restarted:
            step["sandbox_restarted"] = True
        stream = pb.EpisodeTurn(
            action=command,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            output_head=output[:OUTPUT_HEAD_CHARS],
            output_bytes=len(result.output) + result.bytes_dropped,
            submitted=submitted is not None,
            exec_duration=duration_pb(exec_s),
        )
        if submitted is not None:
            observation = output
        else:
            observation = await render_command(
                self._spec,
                self._cpu,
                result.exit_code,
                output,
                result.timed_out,
                restarted,
                turn.turns_left,
            )
        turn.messages.append({"role": "user", "content": observation})
        return Acted(stream, observation, submitted, 1, exec_s, command, result.exit_code, output)

    def limit(self) -> tuple[str, str] | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def branch(self) -> BashBlockActions:
        copied = BashBlockActions(self._spec, self._cpu)
        copied.last_killed = self.last_killed
        return copied


async def render_command(
    spec: EpisodeSpec,
    cpu: RunCpu[str],
    code: int,
    output: str,
    timed_out: bool,
    restarted: bool,
    left: int | None = None,
) -> str:
    """A command's observation (bash blocks, and the `bash` tool of tool calls), with the notes
    on a kill or a restarted sandbox, rendered in the episode's CPU pool."""
    notes = command_notes(code, timed_out, restarted)
    return await cpu(
        lambda: render_observation(
            spec.config,
            exit_code=code,
            output=notes + output,
            timed_out=timed_out,
            timeout_s=spec.command_timeout_s,
            turns_left=left,
        )
    )
