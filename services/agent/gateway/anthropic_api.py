"""Anthropic Messages in Anthropic's own shapes: the message, its SSE events, errors.

Shapes as the `anthropic` SDK's types define them (Message with thinking/text/tool_use blocks,
the message_start … message_stop event stream, `{"type": "error", "error": {type, message}}`).
Tool-use ids are the parser's call ids with Anthropic's `toolu_` prefix.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from swerl.agent.gateway.errors import GatewayError
from swerl.agent.gateway.session import CallAnswer

_ERRORS = {
    "invalid_request": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error",
    # Anthropic's own type for a body over its maximum size (HTTP 413).
    "request_too_large": "request_too_large",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "aborted": "invalid_request_error",
    "unavailable": "api_error",
}


def error_body(error: GatewayError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": _ERRORS.get(error.kind, "api_error"), "message": error.message},
    }


def internal_error_body() -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": "api_error", "message": "The gateway failed to answer this call."},
    }


def _stop_reason(answer: CallAnswer) -> str:
    if answer.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if answer.tool_calls else "end_turn"


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _blocks(answer: CallAnswer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    for call in answer.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": call.arguments,
            }
        )
    return blocks


def _message(answer: CallAnswer, content: list[dict[str, Any]], stop: str | None) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "output_tokens": answer.completion_tokens if stop else 0,
        },
    }


def message(answer: CallAnswer) -> dict[str, Any]:
    return _message(answer, _blocks(answer), _stop_reason(answer))


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()


def stream_events(answer: CallAnswer) -> Iterator[bytes]:
    yield _event("message_start", {"message": _message(answer, [], None)})
    for index, block in enumerate(_blocks(answer)):
        kind = block["type"]
        if kind == "thinking":
            yield _event(
                "content_block_start",
                {
                    "index": index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                },
            )
            yield _event(
                "content_block_delta",
                {
                    "index": index,
                    "delta": {"type": "thinking_delta", "thinking": block["thinking"]},
                },
            )
        elif kind == "text":
            yield _event(
                "content_block_start",
                {"index": index, "content_block": {"type": "text", "text": ""}},
            )
            yield _event(
                "content_block_delta",
                {"index": index, "delta": {"type": "text_delta", "text": block["text"]}},
            )
        else:
            start = {**block, "input": {}}
            yield _event("content_block_start", {"index": index, "content_block": start})
            yield _event(
                "content_block_delta",
                {
                    "index": index,
                    "delta": {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(block["input"]),
                    },
                },
            )
        yield _event("content_block_stop", {"index": index})
    yield _event(
        "message_delta",
        {
            "delta": {"stop_reason": _stop_reason(answer), "stop_sequence": None},
            "usage": {"output_tokens": answer.completion_tokens},
        },
    )
    yield _event("message_stop", {})


def stream_error(error_body_: dict[str, Any]) -> bytes:
    return f"event: error\ndata: {json.dumps(error_body_)}\n\n".encode()
