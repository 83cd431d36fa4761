"""Requests of both protocols as one conversation: chat-template messages, tools, and a match key
per message.

The messages are what the policy's chat template takes (`role`, `content`, `tool_calls` with
parsed arguments, `tool_call_id`); OpenAI `developer` messages become `system`, Anthropic
`tool_result` blocks become `tool` messages, Anthropic tools become function tools, so one
session may even mix the two protocols. A message's key is its canonical JSON without the parts a
client may drop or rewrite when it echoes the model's own turn (reasoning, tool-call ids): the
session finds the recorded call a request continues by these keys, so a key tells apart every two
messages the template renders differently from what the key holds (JSON's types, key order).

Every refusal is a MalformedRequest naming the field, in the protocol's own field path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swerl.agent.gateway.errors import MalformedRequest
from swerl.agent.gateway.incremental import BodyReader, DigestMemo, Group, MessageMemo, roll

Message = dict[str, Any]

_OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")
# How deep tool arguments and tool schemas may nest: the template writes them with `tojson`
# inside its own frames, and a value near Python's recursion limit fails there, not here.
MAX_JSON_DEPTH = 64


@dataclass
class ToolCall:
    """One tool call of an assistant turn: its id, the function's name and parsed arguments."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Conversation:
    """One request, protocol-neutral."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    stream: bool
    model: str
    include_usage: bool = False
    keys: list[bytes] = field(default_factory=list)
    # Rolling digests of tools + messages (chain_digests), when the reader computed them.
    digests: list[bytes] = field(default_factory=list)
    # The request body's size (set by the reader): what rendering it whole may cost.
    body_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.keys:
            self.keys = [message_key(m) for m in self.messages]

    def tools_key(self) -> bytes:
        return _canonical(self.tools or [])


def _canonical(value: Any) -> bytes:
    """The value's JSON, keys in the client's order: the chat template writes tools and tool-call
    arguments with `tojson`, which keeps that order, so two orders are two prompts. JSON's own
    distinctions hold (`true`, `1`, `1.0`, `"1"` and `-0.0` are five keys)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def message_key(message: Mapping[str, Any]) -> bytes:
    """What identifies a message when a client echoes it: role, text and tool calls (name and
    arguments), not reasoning or ids. Role and text are joined raw (NUL-separated; a JSON dump
    of every message's text would escape the whole history again on every call)."""
    calls = message.get("tool_calls")
    tail = (
        _canonical([[c["function"]["name"], c["function"]["arguments"]] for c in calls])
        if calls
        else b""
    )
    return b"\x00".join((message["role"].encode(), (message.get("content") or "").encode(), tail))


def chain_digests(seed: bytes, keys: Sequence[bytes]) -> list[bytes]:
    """Rolling digests: entry i identifies seed + keys[: i + 1]."""
    out = []
    digest = hashlib.blake2b(seed, digest_size=16).digest()
    for key in keys:
        digest = roll(digest, key)
        out.append(digest)
    return out


class ConversationReader:
    """One session's reader of one protocol's request bodies: the body, the conversation and
    its digests, each in time proportional to the new messages (see incremental.py)."""

    def __init__(self, conversation: Callable[[Any, MessageMemo | None], Conversation]) -> None:
        self._conversation = conversation
        self.body = BodyReader()
        self.memo = MessageMemo()
        self.digests = DigestMemo()

    def read(self, raw: bytes) -> Conversation:
        """Decode, check and convert a request body, and digest its history. Raises ValueError
        for bad JSON and MalformedRequest for a bad field."""
        conv = self._conversation(self.body.decode(raw), self.memo)
        conv.digests = self.digests.digests(conv.tools_key(), conv.keys)
        conv.body_bytes = len(raw)
        return conv


def assistant_message(content: str, reasoning: str | None, calls: Sequence[ToolCall]) -> Message:
    message: Message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


# -- shared field checks ---------------------------------------------------------------------------


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise MalformedRequest("the request body must be a JSON object", param="body")
    return body


def _max_tokens(body: Mapping[str, Any], names: Sequence[str], *, required: bool) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MalformedRequest(f"{name} must be a positive integer", param=name)
        return value
    if required:
        raise MalformedRequest(f"{names[0]}: Field required", param=names[0])
    return None


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise MalformedRequest("model: a non-empty string is required", param="model")
    return model


def _stream(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise MalformedRequest("stream must be a boolean", param="stream")
    return stream


def _shallow(value: Any, where: str) -> Any:
    """`value` when it nests at most MAX_JSON_DEPTH levels; else a MalformedRequest naming it.
    Iterative (a deep value must not exhaust the stack that checks it) and stops at the limit."""
    level: list[Any] = [value]
    for _ in range(MAX_JSON_DEPTH + 1):
        below: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                below.extend(item.values())
            elif isinstance(item, list):
                below.extend(item)
        if not below:
            return value
        level = below
    raise MalformedRequest(
        f"{where} nests arrays or objects more than {MAX_JSON_DEPTH} levels deep", param=where
    )


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except RecursionError as err:
            raise MalformedRequest(f"{where} nests too deeply to decode", param=where) from err
        except ValueError as err:
            raise MalformedRequest(f"{where} is not valid JSON: {err}", param=where) from err
    if not isinstance(raw, dict):
        raise MalformedRequest(f"{where} must be a JSON object", param=where)
    return _shallow(raw, where)  # type: ignore[no-any-return]


def _text_parts(content: Any, where: str, *, text_type: str = "text") -> str:
    """String content, or a list of text parts joined; images, audio and files are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MalformedRequest(f"{where} must be a string or a list of parts", param=where)
    texts = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise MalformedRequest(f"{here} must be an object", param=here)
        kind = part.get("type")
        if kind == text_type or kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise MalformedRequest(f"{here}.text must be a string", param=f"{here}.text")
            texts.append(text)
        elif kind in ("image_url", "image", "input_audio", "audio", "file", "document"):
            raise MalformedRequest(
                f"{here}: content of type {kind!r} is not supported, this model takes text only",
                param=here,
            )
        else:
            raise MalformedRequest(f"{here}.type {kind!r} is not supported", param=f"{here}.type")
    return "".join(texts)


# -- OpenAI Chat Completions -----------------------------------------------------------------------


def _openai_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise MalformedRequest(f"{where} must be a list", param=where)
    calls = []
    for k, call in enumerate(raw):
        here = f"{where}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise MalformedRequest(f"{here}.function.name is required", param=f"{here}.function")
        arguments = _arguments(function.get("arguments", "{}"), f"{here}.function.arguments")
        calls.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def _openai_message(raw: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise MalformedRequest(f"{where} must be an object", param=where)
    role = raw.get("role")
    if role not in _OPENAI_ROLES:
        raise MalformedRequest(
            f"{where}.role {role!r} is not one of {', '.join(_OPENAI_ROLES)}",
            param=f"{where}.role",
        )
    content = _text_parts(raw.get("content"), f"{where}.content")
    if role == "developer":
        role = "system"
    message: Message = {"role": role, "content": content}
    if role == "assistant":
        if raw.get("tool_calls"):
            message["tool_calls"] = _openai_tool_calls(raw["tool_calls"], f"{where}.tool_calls")
        reasoning = raw.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            message["reasoning_content"] = reasoning
    elif role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str):
            raise MalformedRequest(
                f"{where}.tool_call_id is required for tool messages",
                param=f"{where}.tool_call_id",
            )
        message["tool_call_id"] = call_id
    elif raw.get("content") is None:
        raise MalformedRequest(f"{where}.content is required", param=f"{where}.content")
    return message


def _openai_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    raw = body.get("tools")
    if raw is None:
        raw = []  # the tool_choice checks below still apply
    if not isinstance(raw, list):
        raise MalformedRequest("tools must be a list", param="tools")
    tools: list[dict[str, Any]] = []
    for k, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise MalformedRequest(
                f"tools[{k}] must be a function tool with function.name", param=f"tools[{k}]"
            )
        tools.append({"type": "function", "function": _shallow(function, f"tools[{k}]")})
    choice = body.get("tool_choice")
    if choice is None:
        return tools or None
    if not tools:  # OpenAI's own refusal, whatever the choice
        raise MalformedRequest(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are"
            " specified.",
            param="tool_choice",
        )
    if choice == "none":
        return None
    if choice == "auto":
        return tools
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if choice != "required" and not named:
        raise MalformedRequest(f"tool_choice {choice!r} is not supported", param="tool_choice")
    if named:
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str) or not name:
            raise MalformedRequest(
                "tool_choice.function.name: a non-empty string is required",
                param="tool_choice.function.name",
            )
        declared = {tool["function"]["name"] for tool in tools}
        if name not in declared:
            raise MalformedRequest(
                f"Invalid value for 'tool_choice': function {name!r} is not one of the"
                " functions in 'tools'.",
                param="tool_choice",
            )
    raise MalformedRequest(_FORCED_CHOICE, param="tool_choice")


# A choice that forces a tool call: the policy's /generate is not constrained to one, so the
# call is refused rather than answered with text the harness did not allow.
_FORCED_CHOICE = (
    "tool_choice that forces a tool call (OpenAI 'required' or a named function, Anthropic"
    " 'any' or 'tool') cannot be honoured: this gateway does not constrain the policy's"
    " generation to a tool call; use 'auto' (or 'none')"
)


def _keyed(messages: list[Message]) -> Group:
    return [(m, message_key(m)) for m in messages]


def _converted(
    raw_messages: list[Any], one: Callable[[Any, int], list[Message]], memo: MessageMemo | None
) -> tuple[list[Message], list[bytes]]:
    if memo is None:
        messages = [m for i, raw in enumerate(raw_messages) for m in one(raw, i)]
        return messages, [message_key(m) for m in messages]
    return memo.convert(raw_messages, lambda raw, i: _keyed(one(raw, i)))


def openai_conversation(body: Any, memo: MessageMemo | None = None) -> Conversation:
    body = _object(body)
    model = _model(body)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise MalformedRequest("messages must be a non-empty list", param="messages")
    n = body.get("n")
    # `is`, not `in`: `true` and `1.0` compare equal to 1 in Python.
    if n is not None and (type(n) is not int or n < 1):
        raise MalformedRequest("n must be a positive integer", param="n")
    if n is not None and n != 1:
        raise MalformedRequest("n: only 1 choice per request is supported", param="n")
    options = body.get("stream_options")
    messages, keys = _converted(raw_messages, lambda m, i: [_openai_message(m, i)], memo)
    return Conversation(
        messages=messages,
        keys=keys,
        tools=_openai_tools(body),
        max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens"), required=False),
        stream=_stream(body),
        model=model,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


# -- Anthropic Messages ----------------------------------------------------------------------------


def _anthropic_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    raw = body.get("tools")
    if raw is None:
        raw = []  # the tool_choice checks below still apply
    if not isinstance(raw, list):
        raise MalformedRequest("tools: Input should be a valid list", param="tools")
    tools: list[dict[str, Any]] = []
    for k, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise MalformedRequest(f"tools.{k}.name: Field required", param=f"tools.{k}.name")
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        schema = tool.get("input_schema") or {"type": "object"}
        function["parameters"] = _shallow(schema, f"tools.{k}.input_schema")
        tools.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice is None:
        return tools or None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise MalformedRequest(
            f"tool_choice: Input tag {kind!r} found using 'type' does not match any of the"
            " expected tags: 'auto', 'any', 'tool', 'none'",
            param="tool_choice",
        )
    if not tools:  # Anthropic's own refusal
        raise MalformedRequest(
            "tool_choice may only be specified while providing tools.", param="tool_choice"
        )
    if kind == "none":
        return None
    if kind == "auto":
        return tools
    if kind == "tool":
        name = choice.get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str) or not name:
            raise MalformedRequest("tool_choice.name: Field required", param="tool_choice.name")
        if name not in {tool["function"]["name"] for tool in tools}:
            raise MalformedRequest(
                f"tool_choice.name: Tool {name!r} not found in provided tools",
                param="tool_choice.name",
            )
    raise MalformedRequest(_FORCED_CHOICE, param="tool_choice")


def _anthropic_user(content: Any, where: str) -> list[Message]:
    """A user turn: tool_result blocks become tool messages (first, in order), the text after
    them one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise MalformedRequest(f"{where}: Input should be a string or a list", param=where)
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(content):
        here = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise MalformedRequest(f"{here}.tool_use_id: Field required", param=here)
            text = _text_parts(block.get("content"), f"{here}.content")
            out.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in ("image", "document", "audio"):
            raise MalformedRequest(
                f"{here}: content of type {kind!r} is not supported, this model takes text only",
                param=here,
            )
        else:
            raise MalformedRequest(f"{here}.type {kind!r} is not supported", param=here)
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _anthropic_assistant(content: Any, where: str) -> Message:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise MalformedRequest(f"{where}: Input should be a string or a list", param=where)
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        here = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking") or ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise MalformedRequest(f"{here}.name: Field required", param=f"{here}.name")
            arguments = _arguments(block.get("input", {}), f"{here}.input")
            calls.append(
                {
                    "id": str(block.get("id") or ""),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        else:
            raise MalformedRequest(
                f"{here}.type {kind!r} is not supported in an assistant turn", param=here
            )
    message: Message = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _anthropic_message(raw: Any, i: int) -> list[Message]:
    where = f"messages.{i}"
    if not isinstance(raw, dict):
        raise MalformedRequest(f"{where}: Input should be an object", param=where)
    role = raw.get("role")
    if role == "user":
        return _anthropic_user(raw.get("content"), f"{where}.content")
    if role == "assistant":
        return [_anthropic_assistant(raw.get("content"), f"{where}.content")]
    raise MalformedRequest(
        f"{where}.role: Input should be 'user' or 'assistant', got {role!r}",
        param=f"{where}.role",
    )


def anthropic_conversation(body: Any, memo: MessageMemo | None = None) -> Conversation:
    body = _object(body)
    model = _model(body)
    max_tokens = _max_tokens(body, ("max_tokens",), required=True)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise MalformedRequest("messages: a non-empty list is required", param="messages")
    messages: list[Message] = []
    keys: list[bytes] = []
    system = body.get("system")
    if system is not None:
        text = _text_parts(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
            keys.append(message_key(messages[0]))
    rest, rest_keys = _converted(raw_messages, _anthropic_message, memo)
    return Conversation(
        messages=messages + rest,
        keys=keys + rest_keys,
        tools=_anthropic_tools(body),
        max_tokens=max_tokens,
        stream=_stream(body),
        model=model,
    )
