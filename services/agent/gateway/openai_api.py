"""OpenAI Chat Completions in OpenAI's own shapes: the completion, its SSE chunks, errors, models.

Shapes as the `openai` SDK's types define them (ChatCompletion, ChatCompletionChunk, Model and
the `{"error": {message, type, param, code}}` body); reasoning goes in `reasoning_content`, as
SGLang and vLLM return it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from swerl.agent.gateway.errors import GatewayError
from swerl.agent.gateway.session import CallAnswer

# GatewayError.kind -> (error.type, error.code)
_ERRORS: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "context_length_exceeded": ("invalid_request_error", "context_length_exceeded"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "not_found": ("invalid_request_error", "not_found"),
    "aborted": ("invalid_request_error", "session_aborted"),
    "unavailable": ("server_error", "policy_unavailable"),
}


def error_body(error: GatewayError) -> dict[str, Any]:
    kind, code = _ERRORS.get(error.kind, ("server_error", None))
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def internal_error_body() -> dict[str, Any]:
    return {
        "error": {
            "message": "The gateway failed to answer this call.",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }


def _finish(answer: CallAnswer) -> str:
    if answer.finish_reason == "length":
        return "length"
    return "tool_calls" if answer.tool_calls else "stop"


def _calls(answer: CallAnswer) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in answer.tool_calls
    ]


def _usage(answer: CallAnswer) -> dict[str, int]:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def completion(answer: CallAnswer) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content or None}
    if answer.tool_calls:
        message["tool_calls"] = _calls(answer)
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": answer.model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": _finish(answer), "logprobs": None}
        ],
        "usage": _usage(answer),
    }


def stream_events(answer: CallAnswer, include_usage: bool) -> Iterator[bytes]:
    """The completion as SSE `data:` lines, then `data: [DONE]`."""
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": answer.model,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if answer.reasoning:
        yield chunk({"reasoning_content": answer.reasoning})
    if answer.content:
        yield chunk({"content": answer.content})
    for index, call in enumerate(_calls(answer)):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, _finish(answer))
    if include_usage:
        tail = {**base, "choices": [], "usage": _usage(answer)}
        yield b"data: " + json.dumps(tail).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def models(model: str, created: float) -> dict[str, Any]:
    return {"object": "list", "data": [model_entry(model, created)]}


def model_entry(model: str, created: float) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": int(created), "owned_by": "swerl"}
