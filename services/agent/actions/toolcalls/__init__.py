"""Tool-call and reasoning parsers, by SGLang's `--tool-call-parser` / `--reasoning-parser`
names, so a user sets one name for the serving engine and for swerl.

    result = parse_reply(text, tool_call_parser="qwen25", reasoning_parser="qwen3",
                         tools=TOOLS, finish_reason="stop")
    result.content, result.reasoning, result.calls, result.errors

Pure Python (no grpc): the agent's episode loop and the model gateway both use it."""

from __future__ import annotations

from collections.abc import Sequence

from swerl.agent.actions.toolcalls.formats import TOOL_CALL_FORMATS, BlockFormat
from swerl.agent.actions.toolcalls.reasoning import (
    REASONING_PARSERS,
    ReasoningSplit,
    ThinkReasoningParser,
)
from swerl.agent.actions.toolcalls.types import (
    CallError,
    CallIds,
    ErrorKind,
    IdSource,
    ParseResult,
    ToolCall,
    ToolSchema,
    check_call,
    parameter_type,
    tool_names,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_FORMATS",
    "BlockFormat",
    "CallError",
    "CallIds",
    "ErrorKind",
    "IdSource",
    "ParseResult",
    "ReasoningSplit",
    "ThinkReasoningParser",
    "ToolCall",
    "ToolSchema",
    "UnknownParserError",
    "check_call",
    "get_reasoning_parser",
    "get_tool_call_format",
    "parameter_type",
    "parse_reply",
    "tool_names",
]


class UnknownParserError(ValueError):
    """A parser name that is not in the registry (a configuration error, caught at load)."""


def get_tool_call_format(name: str) -> BlockFormat:
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_CALL_FORMATS))
        raise UnknownParserError(f"unknown tool-call parser {name!r} (known: {known})") from None


def get_reasoning_parser(name: str) -> ThinkReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise UnknownParserError(f"unknown reasoning parser {name!r} (known: {known})") from None


IN_REASONING = "a tool call written inside the reasoning block is not run; write it after </think>"


def parse_reply(
    text: str,
    *,
    tool_call_parser: str,
    reasoning_parser: str | None = None,
    tools: Sequence[ToolSchema] = (),
    finish_reason: str = "stop",
    new_id: IdSource | None = None,
) -> ParseResult:
    """Split one sampled reply into reasoning, content and calls.

    Calls are looked for only outside the reasoning block (as the serving engine does); a call
    written inside it becomes an `in_reasoning` error. With `tools` given, each parsed call is
    also checked against the schemas (`unknown_tool`, `bad_arguments`). `finish_reason`
    "length" marks a call the reply ends inside as `truncated` rather than `malformed`."""
    fmt = get_tool_call_format(tool_call_parser)
    ids = new_id or CallIds()
    reasoning: str | None = None
    reasoning_truncated = False
    rest = text
    if reasoning_parser:
        split = get_reasoning_parser(reasoning_parser).split(text)
        reasoning, rest, reasoning_truncated = split.reasoning, split.content, split.truncated
    errors: list[CallError] = []
    if reasoning:
        errors.extend(
            CallError("in_reasoning", IN_REASONING, block.raw) for block in fmt.scan(reasoning)[1]
        )
    content, calls = fmt.parse(rest, tools=tools, finish_reason=finish_reason, new_id=ids)
    if tools:
        calls = [check_call(call, tools) for call in calls]
    errors.extend(call.error for call in calls if call.error is not None)
    return ParseResult(
        content=content,
        reasoning=reasoning,
        calls=tuple(calls),
        errors=tuple(errors),
        reasoning_truncated=reasoning_truncated,
    )
