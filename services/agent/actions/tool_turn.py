"""One turn of the `tool_calls` action protocol: a reply's calls run in order, each answered by
its own tool message; what went wrong is an observation, never an exception. `ToolCallActions` is
the protocol as the loop runs it (`swerl.agent.actions.base`).

The reply is parsed with the config's parsers (token mode: the sampled text; chat mode: the
server's own `tool_calls`). Every call written outside the reasoning block gets a tool message:
its result, or a tool error for a call that could not run (malformed, truncated, an unknown tool,
missing or mistyped arguments, a refused edit). A reply with no call at all (the model just
talked, or wrote its calls inside its reasoning) gets a user message saying so. A reply none of
whose calls ran counts as a format error. A successful `submit` ends the turn: calls after it
are not run.

Messages are kept in the OpenAI chat shape (`tool_calls` on the assistant message, `tool`
messages with `tool_call_id`), which is what chat mode sends, what `traj.json` holds and what the
chat template renders.
"""

from __future__ import annotations

import copy
import functools
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swerl.agent.actions.base import OUTPUT_HEAD_CHARS, Acted, ActionTurn, RunCpu, SandboxBroken
from swerl.agent.actions.bash_block import render_command
from swerl.agent.actions.tool_set import ToolBox, ToolOutcome
from swerl.agent.actions.toolcalls import (
    CallError,
    CallIds,
    ErrorKind,
    ParseResult,
    ToolCall,
    check_call,
    parse_reply,
)
from swerl.agent.config import AgentConfig
from swerl.agent.errors import EpisodeInfraError
from swerl.agent.loop.sandbox import SANDBOX_NOT_RUNNING
from swerl.agent.policy.modes import PolicyTurn
from swerl.agent.spec import EpisodeSpec
from swerl.agent.v1 import agent_pb2 as pb
from swerl.chassis.timeconv import duration_pb


@dataclass
class ToolTurn:
    """What one reply did."""

    assistant: dict[str, Any]  # the reply as an OpenAI assistant message
    replies: list[dict[str, Any]]  # the tool messages (and a user message when no call)
    format_error: bool
    parse_failures: int  # calls that could not be run as written (errors of any kind)
    ran: list[tuple[ToolCall, ToolOutcome]] = field(default_factory=list)
    submission: str | None = None

    @property
    def tools_used(self) -> Counter[str]:
        return Counter(call.name for call, _ in self.ran)

    @property
    def output(self) -> str:
        """What the calls that ran printed (for the PRM)."""
        return "".join(outcome.output or outcome.text for _, outcome in self.ran)

    def turn_pb(self, head_chars: int) -> pb.EpisodeTurn:
        """The turn's stream message: the calls that ran (one per line of `action`), the last
        command's exit code."""
        exit_code, timed_out = 0, False
        for _, outcome in self.ran:
            if outcome.exit_code is not None:
                exit_code, timed_out = outcome.exit_code, outcome.timed_out
        output = self.output
        return pb.EpisodeTurn(
            action="\n".join(outcome.command or call.name for call, outcome in self.ran),
            exit_code=exit_code,
            timed_out=timed_out,
            output_head=output[:head_chars],
            output_bytes=sum(o.output_bytes or len(o.text.encode()) for _, o in self.ran),
            submitted=self.submission is not None,
            format_error=self.format_error,
            exec_duration=duration_pb(sum(o.exec_s for _, o in self.ran)),
        )


@dataclass
class ToolState:
    """An episode's tool-protocol state: call ids, the messages that answered the last reply,
    counts per tool, calls that could not run as written, format errors in a row."""

    call_ids: CallIds
    replies: list[dict[str, Any]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    parse_failures: int = 0
    format_errors: int = 0
    format_errors_in_row: int = 0

    def parse(self, answer: PolicyTurn, config: AgentConfig) -> ParseResult:
        if answer.tool_calls is not None:  # chat mode: the server parsed its own calls
            return parse_chat_reply(
                answer.text, answer.reasoning, answer.tool_calls, config, answer.finish_reason
            )
        return parse_sampled(answer.text, config, answer.finish_reason, self.call_ids)

    def record(self, turn: ToolTurn, step: dict[str, Any]) -> float:
        """Counts a finished turn and fills its `traj.json` step; returns its exec seconds."""
        self.replies = turn.replies
        self.counts.update(turn.tools_used)
        self.parse_failures += turn.parse_failures
        self.format_errors += turn.format_error
        self.format_errors_in_row = self.format_errors_in_row + 1 if turn.format_error else 0
        step.update(
            format_error=turn.format_error,
            tool_parse_failures=turn.parse_failures,
            tool_calls=[
                {
                    "id": call.id,
                    "name": call.name,
                    "command": outcome.command,
                    "error": outcome.error,
                    "exit_code": outcome.exit_code,
                    "timed_out": outcome.timed_out,
                    "exec_s": round(outcome.exec_s, 4),
                }
                for call, outcome in turn.ran
            ],
        )
        return sum(outcome.exec_s for _, outcome in turn.ran)

    def over_limit(self, config: AgentConfig) -> bool:
        limit = config.max_format_errors
        return bool(limit) and self.format_errors_in_row >= limit

    def limit_detail(self, config: AgentConfig) -> tuple[str, str]:
        return (
            "LIMIT_FORMAT_ERRORS",
            f"{config.max_format_errors} replies in a row without a well-formed tool call",
        )

    def metrics(self) -> dict[str, float]:
        """Per-tool call counts and parse failures, for `agent_metrics`."""
        out = {f"tool_calls_{name}": float(n) for name, n in sorted(self.counts.items())}
        out["tool_parse_failures"] = float(self.parse_failures)
        out["format_errors"] = float(self.format_errors)
        return out

    def copy(self) -> ToolState:
        """A branch's copy (the ids go on from the same point)."""
        return copy.deepcopy(self)


def parse_sampled(text: str, config: AgentConfig, finish_reason: str, ids: CallIds) -> ParseResult:
    """A sampled reply read with the config's parsers, checked against its tools."""
    return parse_reply(
        text,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser or None,
        tools=config.tools,
        finish_reason=finish_reason,
        new_id=ids,
    )


def parse_chat_reply(
    content: str,
    reasoning: str | None,
    tool_calls: Sequence[Mapping[str, Any]],
    config: AgentConfig,
    finish_reason: str,
) -> ParseResult:
    """A chat server's reply (its own `tool_calls`, arguments as JSON text) as a ParseResult."""
    calls: list[ToolCall] = []
    for index, item in enumerate(tool_calls):
        function = item.get("function") or {}
        name = str(function.get("name") or "")
        text = function.get("arguments")
        raw = json.dumps(item, ensure_ascii=False)
        call_id = str(item.get("id") or f"call_{index}")
        try:
            arguments = json.loads(text) if isinstance(text, str) and text.strip() else {}
        except json.JSONDecodeError as err:
            kind: ErrorKind = "truncated" if finish_reason == "length" else "malformed"
            error = CallError(kind, f"malformed tool call: invalid JSON arguments ({err.msg})", raw)
            calls.append(ToolCall(call_id, name, None, raw, error))
            continue
        if not isinstance(arguments, dict):
            bad = CallError("malformed", "malformed tool call: arguments must be an object", raw)
            calls.append(ToolCall(call_id, name, None, raw, bad))
            continue
        calls.append(check_call(ToolCall(call_id, name, arguments, raw), config.tools))
    return ParseResult(
        content=content.strip(),
        reasoning=reasoning,
        calls=tuple(calls),
        errors=tuple(call.error for call in calls if call.error is not None),
    )


def assistant_message(parsed: ParseResult) -> dict[str, Any]:
    """The reply as an OpenAI assistant message (a broken call keeps the text it had)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": (
                        json.dumps(call.arguments, ensure_ascii=False)
                        if call.arguments is not None
                        else call.raw
                    ),
                },
            }
            for call in parsed.calls
        ]
    return message


def _note(config: AgentConfig, turns_left: int | None) -> str:
    if turns_left is None or turns_left > config.turns_left_warning:
        return ""
    plural = "" if turns_left == 1 else "s"
    return f"\n<note>{turns_left} turn{plural} left: submit soon.</note>"


async def run_tool_turn(
    parsed: ParseResult, box: ToolBox, config: AgentConfig, turns_left: int | None
) -> ToolTurn:
    """Runs the reply's calls in order and builds the messages that answer them."""
    turn = ToolTurn(
        assistant=assistant_message(parsed),
        replies=[],
        format_error=False,
        parse_failures=len(parsed.errors),
    )
    if not parsed.calls:
        in_reasoning = sum(error.kind == "in_reasoning" for error in parsed.errors)
        text = config.render("no_call_template", turns_left=turns_left, in_reasoning=in_reasoning)
        turn.replies.append({"role": "user", "content": text})
        turn.format_error = True
        return turn
    for call in parsed.calls:
        if call.error is not None:
            text = config.render("tool_error_template", error=_error_text(call.error))
            turn.replies.append(_tool_message(call, text))
            continue
        outcome = await box.run(call)
        turn.ran.append((call, outcome))
        turn.replies.append(_tool_message(call, outcome.text))
        if outcome.submission is not None:
            turn.submission = outcome.submission
            break
    # A bad call (one that could not be run as written) makes the reply a format error; a
    # refused edit or a failing command does not: the call itself was well formed.
    turn.format_error = bool(parsed.errors)
    if turn.submission is None and turn.replies:
        turn.replies[-1]["content"] += _note(config, turns_left)
    return turn


def _error_text(error: CallError) -> str:
    message = error.message
    return message if message.startswith("Error:") else f"Error: {message}"


def _tool_message(call: ToolCall, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


class ToolCallActions:
    """The `tool_calls` protocol as the loop runs it: the reply's calls run in order through
    the episode's `ToolBox`, each answered by its own tool message."""

    name = "tool_calls"

    def __init__(self, spec: EpisodeSpec, cpu: RunCpu[str], state: ToolState) -> None:
        self._spec = spec
        self._cpu = cpu
        self.state = state
        # The last bash call ended killed by a signal (a sandbox found dead after it is the
        # policy's doing).
        self.last_killed = False

    async def act(self, turn: ActionTurn) -> Acted:
        spec, config = self._spec, self._spec.config
        answer = turn.answer
        parsed = self.state.parse(answer, config)
        box = ToolBox(
            turn.sandbox,
            workdir=config.workdir,
            env={**config.env, **spec.env},
            command_timeout_s=spec.command_timeout_s,
            render_bash=functools.partial(render_command, spec, self._cpu),
        )
        box.last_killed = self.last_killed
        step: dict[str, Any] = {"turn": turn.index, "response": answer.text}
        turn.steps.append(step)
        try:
            done = await run_tool_turn(parsed, box, config, turn.turns_left)
        except EpisodeInfraError as err:
            step.update(sandbox_lost=err.message[:500])
            if err.reason == SANDBOX_NOT_RUNNING and box.last_killed:
                raise SandboxBroken(err.message) from err
            raise
        self.last_killed = box.last_killed
        turn.messages += [done.assistant, *done.replies]
        env_s = self.state.record(done, step)
        stream = done.turn_pb(OUTPUT_HEAD_CHARS)
        return Acted(
            stream,
            self.state.replies or turn.messages[-1]["content"],
            done.submission,
            len(done.ran),
            env_s,
            stream.action or None,
            stream.exit_code,
            done.output,
        )

    def limit(self) -> tuple[str, str] | None:
        config = self._spec.config
        return self.state.limit_detail(config) if self.state.over_limit(config) else None

    def metrics(self) -> dict[str, float]:
        return self.state.metrics()

    def branch(self) -> ToolCallActions:
        copied = ToolCallActions(self._spec, self._cpu, self.state.copy())
        copied.last_killed = self.last_killed
        return copied
