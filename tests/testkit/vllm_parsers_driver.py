"""Runs vLLM's own tool-call and reasoning parsers over swerl's parser cases, in vLLM's Python.

vLLM cannot be imported beside swerl (it pins its own torch and transformers), so
testkit.parser_parity starts this file once with the vLLM environment's interpreter
(SWERL_VLLM_PYTHON), writes every case as one JSON document on stdin and reads one JSON document
back: per case, what vLLM's OpenAI server would return for the text, parsed whole (a
non-streaming request) and fed to the parser one token at a time (a streaming one).

It imports nothing of swerl's. The parsers are composed the way vLLM's server composes them for
`--tool-call-parser NAME --reasoning-parser qwen3 --enable-auto-tool-choice`
(`vllm/parser/parser_manager.py` `ParserManager.get_parser`, a `DelegatingParser`), and called
through the two entries its chat-completion server uses: `Parser.parse` and `Parser.parse_delta`
(`vllm/parser/abstract_parser.py`).

    stdin:  {"tokenizer": DIR, "prompt": TEXT, "tools": [...], "cases": [{"id", "tool_call_parser",
             "reasoning_parser", "text"}, ...]}
    stdout: {"vllm_version": V, "results": {ID: {"whole": OUT, "streamed": OUT}}}
    OUT:    {"content": str|null, "reasoning": str|null, "calls": [{"name", "arguments"}]} or
            {"error": "ExceptionType: message"}
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

# Run as a script, this file's folder (tests/testkit) is first on sys.path, and a module of the
# testkit could shadow the package it drives (`import vllm`): only the interpreter's own paths.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _calls_out(calls: list[Any]) -> list[dict[str, Any]]:
    return [{"name": call.name, "arguments": call.arguments} for call in calls]


def _whole(parser_cls: Any, tokenizer: Any, request: Any, text: str) -> dict[str, Any]:
    parser = parser_cls(tokenizer, request.tools)
    ids = tokenizer.encode(text, add_special_tokens=False)
    reasoning, content, calls = parser.parse(
        text, request, enable_auto_tools=True, model_output_token_ids=ids
    )
    return {"content": content, "reasoning": reasoning, "calls": _calls_out(calls or [])}


def _deltas(tokenizer: Any, ids: list[int]) -> list[tuple[str, list[int]]]:
    """The text each token adds, as a detokenizer streams it: a token that ends inside a UTF-8
    character is held back until the character is whole."""
    out: list[tuple[str, list[int]]] = []
    sent = ""
    pending: list[int] = []
    for index, token in enumerate(ids):
        pending.append(token)
        text = tokenizer.decode(ids[: index + 1], skip_special_tokens=False)
        if text.endswith("\ufffd") and index + 1 < len(ids):
            continue
        out.append((text[len(sent) :], pending))
        sent, pending = text, []
    return out


def _streamed(
    parser_cls: Any, tokenizer: Any, request: Any, text: str, prompt_ids: list[int]
) -> dict[str, Any]:
    parser = parser_cls(tokenizer, request.tools)
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    deltas = _deltas(tokenizer, tokenizer.encode(text, add_special_tokens=False))
    for number, (delta_text, delta_ids) in enumerate(deltas):
        message = parser.parse_delta(
            delta_text,
            delta_ids,
            request,
            prompt_token_ids=prompt_ids,
            finished=number == len(deltas) - 1,
        )
        if message is None:
            continue
        content.append(message.content or "")
        reasoning.append(message.reasoning or "")
        for call in message.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            function = call.function
            if function is None:
                continue
            name = function.get("name") if isinstance(function, dict) else function.name
            arguments = (
                function.get("arguments") if isinstance(function, dict) else function.arguments
            )
            if name:
                entry["name"] = name
            entry["arguments"] += arguments or ""
    return {
        "content": "".join(content) or None,
        "reasoning": "".join(reasoning) or None,
        "calls": [calls[index] for index in sorted(calls)],
    }


def _guarded(run: Any, *args: Any) -> dict[str, Any]:
    try:
        result: dict[str, Any] = run(*args)
    except Exception as exc:  # a parser that raises is a result to compare, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    return result


def main() -> None:
    job = json.load(sys.stdin)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.disable(logging.CRITICAL)
    import vllm
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(job["tokenizer"])
    prompt_ids = tokenizer.encode(job["prompt"], add_special_tokens=False)
    request = ChatCompletionRequest(
        model="swerl-parity",
        messages=[{"role": "user", "content": "parity"}],
        tools=job["tools"],
    )
    parsers: dict[tuple[str, str | None], Any] = {}
    results: dict[str, Any] = {}
    for case in job["cases"]:
        key = (case["tool_call_parser"], case["reasoning_parser"])
        if key not in parsers:
            parsers[key] = ParserManager.get_parser(
                tool_parser_name=key[0],
                reasoning_parser_name=key[1],
                enable_auto_tools=True,
                tokenizer=tokenizer,
            )
        parser_cls = parsers[key]
        results[case["id"]] = {
            "whole": _guarded(_whole, parser_cls, tokenizer, request, case["text"]),
            "streamed": _guarded(
                _streamed, parser_cls, tokenizer, request, case["text"], prompt_ids
            ),
        }
    json.dump({"vllm_version": vllm.__version__, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
