"""The policy's sampled text as an assistant turn: reasoning, content and tool calls, read by the
agent's tool-call and reasoning parsers (`swerl.agent.actions.toolcalls`, named like SGLang's
`--tool-call-parser` / `--reasoning-parser`).

As SGLang's OpenAI server does, a call whose arguments parse is returned as a tool call even
when it does not fit the declared schema (the harness reports that to the model); a call that
cannot be read at all stays in the content as the model wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swerl.agent.actions.toolcalls import (
    REASONING_PARSERS,
    TOOL_CALL_FORMATS,
    parse_reply,
)
from swerl.agent.gateway.errors import InvalidSessionSpec
from swerl.agent.gateway.messages import ToolCall

# The parsers of a session that names none (an OpenSession without them, a harness episode whose
# agent config names none): Qwen3's (Hermes-style <tool_call> JSON, <think> reasoning), the
# family of the bundled tokenizer. A `tool_calls` agent config (e.g. `tools`) names the policy
# model's own.
DEFAULT_TOOL_CALL_PARSER = "qwen25"
DEFAULT_REASONING_PARSER = "qwen3"
NO_REASONING = "none"


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]


class OutputParser:
    """The parsers one session uses."""

    def __init__(self, tool_call_parser: str, reasoning_parser: str | None) -> None:
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    def parse(
        self, text: str, tools: Sequence[dict[str, Any]] | None, finish_reason: str = "stop"
    ) -> ParsedOutput:
        result = parse_reply(
            text,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            tools=tools or (),
            finish_reason=finish_reason,
        )
        calls: list[ToolCall] = []
        unread: list[str] = []
        for call in result.calls:
            if call.arguments is None or not call.name:
                unread.append(call.raw)
            else:
                calls.append(ToolCall(call.id, call.name, call.arguments))
        content = "\n".join(part for part in (result.content, *unread) if part)
        return ParsedOutput(content=content, reasoning=result.reasoning, tool_calls=calls)


def output_parser(tool_call_parser: str, reasoning_parser: str) -> OutputParser:
    """The parsers a session names (defaults: qwen25 and qwen3); unknown names are refused."""
    tool_name = tool_call_parser or DEFAULT_TOOL_CALL_PARSER
    reasoning_name = reasoning_parser or DEFAULT_REASONING_PARSER
    if tool_name not in TOOL_CALL_FORMATS:
        known = ", ".join(sorted(TOOL_CALL_FORMATS))
        raise InvalidSessionSpec(
            f"unknown tool_call_parser {tool_name!r} (known: {known})",
            field="tool_call_parser",
        )
    if reasoning_name != NO_REASONING and reasoning_name not in REASONING_PARSERS:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise InvalidSessionSpec(
            f"unknown reasoning_parser {reasoning_name!r} (known: {known}, none)",
            field="reasoning_parser",
        )
    return OutputParser(tool_name, None if reasoning_name == NO_REASONING else reasoning_name)
