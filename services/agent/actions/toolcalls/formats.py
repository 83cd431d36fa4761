"""Tool-call formats, named as SGLang's `--tool-call-parser` values, each one reading the calls a
model writes in its own syntax and writing a call the way the model's chat template renders it.

- `qwen25` (alias `qwen`): Qwen2.5/Qwen3, Hermes style, one JSON object per block:
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
- `qwen3_coder`: Qwen3-Coder's XML, every value as text:
  `<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`
- `glm45` (alias `glm`): GLM-4.5/4.6, `<tool_call>f\\n<arg_key>p</arg_key>\\n<arg_value>value
  </arg_value>\\n</tool_call>`; `glm47`: GLM-4.7, the same without the newlines.

In the XML formats a value is kept as text when the tool declares the parameter a string, and
read as JSON otherwise (falling back to the text), as the engines do; file contents therefore
arrive byte for byte (no HTML unescaping, no JSON decoding of a string parameter)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swerl.agent.actions.toolcalls.types import (
    CallError,
    IdSource,
    ToolCall,
    ToolSchema,
    parameter_type,
)


@dataclass(frozen=True)
class Block:
    """One call's text between the start and end markers; `closed` is False for a call the reply
    ends inside."""

    raw: str
    body: str
    closed: bool


class CallSyntaxError(ValueError):
    """A call block whose inside does not follow the format."""


class BlockFormat:
    """A format whose calls sit between fixed start and end markers. Subclasses read one block's
    inside (`read_body`) and write one call (`render_call`)."""

    name = ""
    start = "<tool_call>"
    end = "</tool_call>"

    def scan(self, text: str) -> tuple[str, list[Block]]:
        """The text outside the calls, and the call blocks in order."""
        outside: list[str] = []
        blocks: list[Block] = []
        cursor = 0
        while True:
            begin = text.find(self.start, cursor)
            if begin == -1:
                outside.append(text[cursor:])
                break
            outside.append(text[cursor:begin])
            stop = text.find(self.end, begin + len(self.start))
            if stop == -1:
                blocks.append(Block(text[begin:], text[begin + len(self.start) :], False))
                break
            blocks.append(
                Block(
                    text[begin : stop + len(self.end)], text[begin + len(self.start) : stop], True
                )
            )
            cursor = stop + len(self.end)
        return "".join(outside), blocks

    def parse(
        self,
        text: str,
        *,
        tools: Sequence[ToolSchema],
        finish_reason: str,
        new_id: IdSource,
    ) -> tuple[str, list[ToolCall]]:
        """The content outside the calls and every call, runnable or not, in order."""
        content, blocks = self.scan(text)
        calls = [self._call(block, tools, finish_reason, new_id) for block in blocks]
        return content.strip(), calls

    def _call(
        self, block: Block, tools: Sequence[ToolSchema], finish_reason: str, new_id: IdSource
    ) -> ToolCall:
        if not block.closed:
            if finish_reason == "length":
                error = CallError(
                    "truncated",
                    f"the reply hit the token limit inside a tool call (no {self.end})",
                    block.raw,
                )
            else:
                error = CallError("malformed", f"tool call not closed with {self.end}", block.raw)
            return ToolCall(new_id(), self._guess_name(block.body), None, block.raw, error)
        try:
            name, arguments = self.read_body(block.body, tools)
        except CallSyntaxError as exc:
            bad = CallError("malformed", f"malformed tool call: {exc}", block.raw)
            return ToolCall(new_id(), self._guess_name(block.body), None, block.raw, bad)
        return ToolCall(new_id(), name, arguments, block.raw)

    def read_body(
        self, body: str, tools: Sequence[ToolSchema]
    ) -> tuple[str, dict[str, Any]]:  # pragma: no cover - every format overrides it
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:  # pragma: no cover
        raise NotImplementedError

    def _guess_name(self, body: str) -> str:
        """The tool name of a broken call when it can still be read (for metrics)."""
        return ""


class HermesJsonFormat(BlockFormat):
    """`qwen25`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

    name = "qwen25"
    _NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')

    def read_body(self, body: str, tools: Sequence[ToolSchema]) -> tuple[str, dict[str, Any]]:
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            raise CallSyntaxError(
                f"invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
            ) from None
        if not isinstance(payload, dict):
            raise CallSyntaxError('expected a JSON object {"name": ..., "arguments": {...}}')
        name = payload.get("name")
        if not isinstance(name, str) or not name:
            raise CallSyntaxError('"name" must be a non-empty string')
        arguments = payload.get("arguments", payload.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise CallSyntaxError('"arguments" is a string that is not a JSON object') from None
        if not isinstance(arguments, dict):
            raise CallSyntaxError('"arguments" must be a JSON object')
        return name, arguments

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        # What Qwen's template writes for an assistant tool call (arguments through `tojson`).
        return (
            f'{self.start}\n{{"name": "{name}", "arguments": '
            f"{json.dumps(arguments, ensure_ascii=False)}}}\n{self.end}"
        )

    def _guess_name(self, body: str) -> str:
        found = self._NAME.search(body)
        return found.group(1) if found else ""


def _typed_value(text: str, tools: Sequence[ToolSchema], tool: str, parameter: str) -> Any:
    """A value written as text: kept as text for a string parameter, else read as JSON (a bare
    Python-style True/False/None too), else kept as text for the schema check to judge."""
    declared = parameter_type(tools, tool, parameter)
    if declared == "string":
        return text
    stripped = text.strip()
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        pass
    literal = {"True": True, "False": False, "None": None}
    if stripped in literal and declared in ("boolean", "null", None):
        return literal[stripped]
    return text


def _rendered_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class Qwen3CoderFormat(BlockFormat):
    """`qwen3_coder`: `<function=name>` with `<parameter=key>` children inside `<tool_call>`."""

    name = "qwen3_coder"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
    _PARAMETER = re.compile(
        r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL
    )

    def read_body(self, body: str, tools: Sequence[ToolSchema]) -> tuple[str, dict[str, Any]]:
        found = self._FUNCTION.match(body)
        if found is None:
            raise CallSyntaxError("expected <function=NAME> right after <tool_call>")
        name = found.group(1).strip()
        inside = found.group(2)
        arguments: dict[str, Any] = {}
        cursor = 0
        for parameter in self._PARAMETER.finditer(inside):
            if inside[cursor : parameter.start()].strip():
                raise CallSyntaxError(
                    f"text outside <parameter=...>: {inside[cursor : parameter.start()].strip()!r}"
                )
            cursor = parameter.end()
            key = parameter.group(1).strip()
            value = parameter.group(2)
            # The template writes "\n" after the opening tag and before the closing one.
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            if key in arguments:
                raise CallSyntaxError(f"parameter {key!r} given twice")
            arguments[key] = _typed_value(value, tools, name, key)
        if inside[cursor:].strip():
            raise CallSyntaxError(f"text outside <parameter=...>: {inside[cursor:].strip()!r}")
        return name, arguments

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        parameters = "".join(
            f"<parameter={key}>\n{_rendered_value(value)}\n</parameter>\n"
            for key, value in arguments.items()
        )
        return f"{self.start}\n<function={name}>\n{parameters}</function>\n{self.end}"

    def _guess_name(self, body: str) -> str:
        found = re.search(r"<function=([^>\n]+)>", body)
        return found.group(1).strip() if found else ""


class GlmFormat(BlockFormat):
    """`glm45` / `glm47`: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...`;
    GLM-4.5 puts a newline after the name and after each tag pair, GLM-4.7 none."""

    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def __init__(self, name: str, newlines: bool) -> None:
        self.name = name
        self.newlines = newlines

    def read_body(self, body: str, tools: Sequence[ToolSchema]) -> tuple[str, dict[str, Any]]:
        head, _, _ = body.partition("<arg_key>")
        name = head.strip()
        if not name or "<" in name or "\n" in name:
            raise CallSyntaxError("expected the tool name right after <tool_call>")
        rest = body[len(head) :]
        arguments: dict[str, Any] = {}
        cursor = 0
        for pair in self._PAIR.finditer(rest):
            if rest[cursor : pair.start()].strip():
                raise CallSyntaxError(
                    f"text outside <arg_key>/<arg_value>: {rest[cursor : pair.start()].strip()!r}"
                )
            cursor = pair.end()
            key = pair.group(1).strip()
            if key in arguments:
                raise CallSyntaxError(f"argument {key!r} given twice")
            arguments[key] = _typed_value(pair.group(2), tools, name, key)
        if rest[cursor:].strip():
            raise CallSyntaxError(
                f"an <arg_key> without its <arg_value> (or stray text): {rest[cursor:].strip()!r}"
            )
        return name, arguments

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        gap = "\n" if self.newlines else ""
        pairs = "".join(
            f"<arg_key>{key}</arg_key>{gap}<arg_value>{_rendered_value(value)}</arg_value>{gap}"
            for key, value in arguments.items()
        )
        return f"{self.start}{name}{gap}{pairs}{self.end}"

    def _guess_name(self, body: str) -> str:
        head = body.partition("<arg_key>")[0].strip()
        return head if head and "<" not in head and "\n" not in head else ""


TOOL_CALL_FORMATS: dict[str, BlockFormat] = {
    "qwen25": HermesJsonFormat(),
    "qwen": HermesJsonFormat(),
    "qwen3_coder": Qwen3CoderFormat(),
    "glm45": GlmFormat("glm45", newlines=True),
    "glm": GlmFormat("glm45", newlines=True),
    "glm47": GlmFormat("glm47", newlines=False),
}
