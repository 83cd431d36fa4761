"""What a parsed model reply is: its visible content, its reasoning, the tool calls it made and
what was wrong with each. Pure data; the parsers in this package build it, the agent loop and
the model gateway read it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# Why a call is not runnable. Parser-level kinds: `malformed` (the call's syntax or JSON is
# broken), `truncated` (the reply stopped at the token limit inside the call), `in_reasoning`
# (the call was written inside the reasoning block, where the serving engine does not look for
# calls either). Schema-level kinds, from `check_call`: `unknown_tool`, `bad_arguments`.
ErrorKind = Literal["malformed", "truncated", "in_reasoning", "unknown_tool", "bad_arguments"]

# A tool as the OpenAI chat API and the chat templates take it:
# {"type": "function", "function": {"name": ..., "description": ..., "parameters": {JSON schema}}}
ToolSchema = Mapping[str, Any]


@dataclass(frozen=True)
class CallError:
    """One thing wrong with one call (the text the model sees is built from `message`)."""

    kind: ErrorKind
    message: str
    raw: str  # the call's text as the model wrote it (empty when there is none)


@dataclass(frozen=True)
class ToolCall:
    """One call found in a reply, runnable or not, in the order the model wrote it."""

    id: str
    name: str  # empty when the parser could not read a name
    # The arguments as parsed JSON; None when they could not be parsed.
    arguments: dict[str, Any] | None
    raw: str  # the call's whole text, start and end markers included
    error: CallError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class ParseResult:
    """A reply split into content, reasoning and calls.

    `calls` holds every call written outside the reasoning block, runnable or not, in order, so
    each gets its own tool message. `errors` holds every problem: the failed calls' errors and
    one `in_reasoning` error per call written inside the reasoning block (those are not run)."""

    content: str  # the text outside reasoning and outside calls, stripped
    reasoning: str | None  # None when the reply has no reasoning block
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[CallError, ...] = ()
    # The reply ended inside the reasoning block (finish_reason length, or no end marker).
    reasoning_truncated: bool = False

    @property
    def runnable(self) -> tuple[ToolCall, ...]:
        return tuple(call for call in self.calls if call.ok)


@dataclass
class CallIds:
    """Call ids: `call_` + 24 hex digits, as OpenAI and SGLang write them; `seed` gives a
    reproducible sequence (replays, tests)."""

    seed: int | None = None
    _counter: int = field(default=0, init=False)

    def __call__(self) -> str:
        if self.seed is None:
            return f"call_{uuid.uuid4().hex[:24]}"
        self._counter += 1
        return f"call_{self.seed & 0xFFFFFFFFFFFF:012x}{self._counter:012x}"


IdSource = Callable[[], str]


def tool_names(tools: Sequence[ToolSchema]) -> list[str]:
    return [str(_function(tool).get("name", "")) for tool in tools]


def _function(tool: ToolSchema) -> Mapping[str, Any]:
    inner = tool.get("function")
    return inner if isinstance(inner, Mapping) else tool


def parameter_type(tools: Sequence[ToolSchema], tool: str, parameter: str) -> str | None:
    """The JSON-schema `type` the tool declares for a parameter (None: unknown or untyped). The
    XML formats write every value as text; this decides whether the text is kept as a string or
    read as JSON, as the serving engines do."""
    for candidate in tools:
        function = _function(candidate)
        if function.get("name") != tool:
            continue
        properties = (function.get("parameters") or {}).get("properties") or {}
        spec = properties.get(parameter) if isinstance(properties, Mapping) else None
        kind = spec.get("type") if isinstance(spec, Mapping) else None
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"]
            kind = kinds[0] if len(kinds) == 1 else None
        return kind if isinstance(kind, str) else None
    return None


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_call(call: ToolCall, tools: Sequence[ToolSchema]) -> ToolCall:
    """The call with a schema-level error added when it names no declared tool, lacks a required
    argument, passes one the tool does not declare, or passes one of the wrong JSON type. A call
    that already has an error is returned as is."""
    if call.error is not None or call.arguments is None:
        return call
    function = next((_function(t) for t in tools if _function(t).get("name") == call.name), None)
    if function is None:
        known = ", ".join(tool_names(tools)) or "none"
        return _failed(call, "unknown_tool", f"unknown tool {call.name!r} (tools: {known})")
    schema = function.get("parameters") or {}
    properties: Mapping[str, Any] = schema.get("properties") or {}
    missing = [name for name in schema.get("required") or () if name not in call.arguments]
    if missing:
        return _failed(
            call,
            "bad_arguments",
            f"{call.name}: missing required argument(s): {', '.join(missing)}",
        )
    for name, value in call.arguments.items():
        if name not in properties:
            allowed = ", ".join(properties) or "none"
            return _failed(
                call, "bad_arguments", f"{call.name}: unknown argument {name!r} (takes: {allowed})"
            )
        spec = properties[name]
        problem = _type_problem(value, spec if isinstance(spec, Mapping) else {})
        if problem:
            return _failed(call, "bad_arguments", f"{call.name}: argument {name!r} {problem}")
    return call


def _type_problem(value: object, spec: Mapping[str, Any]) -> str | None:
    kind = spec.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else []
    if kinds and not any(_is_type(value, k) for k in kinds):
        return f"must be {' or '.join(kinds)}, got {_json_type(value)}"
    enum = spec.get("enum")
    if isinstance(enum, list) and value not in enum:
        return f"must be one of {', '.join(map(str, enum))}, got {value!r}"
    if isinstance(value, list) and isinstance(spec.get("items"), Mapping):
        for item in value:
            problem = _type_problem(item, spec["items"])
            if problem:
                return f"items {problem}"
    return None


def _is_type(value: object, kind: str) -> bool:
    if kind == "null":
        return value is None
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(kind, (object,)))


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    for name in _JSON_TYPES:
        if name != "number" and _is_type(value, name):
            return name
    return "number" if isinstance(value, (int, float)) else type(value).__name__


def _failed(call: ToolCall, kind: ErrorKind, message: str) -> ToolCall:
    return ToolCall(
        id=call.id,
        name=call.name,
        arguments=call.arguments,
        raw=call.raw,
        error=CallError(kind, message, call.raw),
    )
