"""swerl's tool-call and reasoning parsers beside vLLM's own, on one corpus of replies.

The corpus (tests/agent/data/parser_cases.json) holds model replies in both call syntaxes swerl
and vLLM share: Hermes-style `<tool_call>{json}</tool_call>` (swerl's `qwen25`, vLLM's `hermes`)
and Qwen3-Coder's `<function=...><parameter=...>` (`qwen3_coder` in both), with `<think>`
reasoning (`qwen3` in both). swerl's side is what the model gateway returns for the reply
(`swerl.agent.gateway.parsing.OutputParser`: content, reasoning, the calls it hands the client);
vLLM's side is what its OpenAI server returns, non-streaming and streaming, from
testkit/vllm_parsers_driver.py run once in vLLM's own Python (SWERL_VLLM_PYTHON).

Each case agrees or is listed in DIFFERENCES with the reason swerl differs; tests/agent/
test_vllm_parsers.py holds the two to each other, and

    scripts/parity-table        # SWERL_VLLM_PYTHON set

writes the table to docs/parsers-vs-vllm.md.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swerl.agent.gateway.parsing import output_parser
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
CASES_PATH = ROOT / "tests/agent/data/parser_cases.json"
DRIVER_PATH = Path(__file__).resolve().with_name("vllm_parsers_driver.py")
TABLE_PATH = ROOT / "docs/parsers-vs-vllm.md"

# vLLM's parser names -> swerl's (SGLang's) for the same syntax.
SWERL_TOOL_PARSER = {"hermes": "qwen25", "qwen3_coder": "qwen3_coder"}
SWERL_REASONING_PARSER = {"qwen3": "qwen3", None: "none"}

# Why vLLM's `qwen3` reads a reply that does not open `<think>` as reasoning: its parser starts
# every reply inside the reasoning block (vllm/parser/qwen3.py:102, `initial_state=REASONING`
# while `enable_thinking` is on, the default) and ends it at `</think>` or at the first
# `<tool_call>` (vllm/parser/qwen3.py:141). swerl's `qwen3` is SGLang's: reasoning only where the
# reply opens `<think>` or carries `</think>`.
_STARTS_IN_REASONING = (
    "vLLM's `qwen3` starts every reply inside reasoning (vllm/parser/qwen3.py:102) and ends it at "
    "the first `<tool_call>` (qwen3.py:141), so text before a call (or a whole reply with no "
    "`<think>`) is reasoning there; swerl's `qwen3` is SGLang's, which finds reasoning only in a "
    "reply that opens `<think>` or carries `</think>`, and keeps this text as content"
)
_IN_REASONING = (
    "a call written inside `<think>` ends vLLM's reasoning (vllm/parser/qwen3.py:141) and is run; "
    "swerl, as SGLang, looks for calls only after the reasoning block and does not run it"
)
_CONTENT_AFTER_CALL = (
    "vLLM's `hermes` keeps only the text before the first `<tool_call>` as content "
    "(vllm/tool_parsers/hermes_tool_parser.py:109) and drops the text after the last call; swerl "
    "returns all text outside the calls, as SGLang does"
)
_HERMES_BAD_CALL = (
    "one block that is not JSON makes vLLM's `hermes` give up on the whole reply "
    "(hermes_tool_parser.py:116: no call, the raw text as content), dropping the good calls "
    "beside it; swerl returns each call that parses and leaves only the bad block in the content"
)

_STREAMS_BROKEN_CALL = (
    "vLLM's streaming `hermes` sends a call's name and its arguments as they arrive, before the "
    "block is known to be whole JSON (vllm/tool_parsers/hermes_tool_parser.py:235-262), so a "
    "streaming client is handed a call whose arguments do not parse (vLLM's own non-streaming "
    "reading agrees with swerl); swerl parses whole replies and returns the unreadable block as "
    "content"
)

DIFFERENCES: dict[str, str] = {
    "hermes-unicode": _STARTS_IN_REASONING,
    "hermes-no-call": _STARTS_IN_REASONING,
    "coder-unicode": _STARTS_IN_REASONING,
    "coder-no-call": _STARTS_IN_REASONING,
    "hermes-text-before-and-after": f"{_STARTS_IN_REASONING}; and {_CONTENT_AFTER_CALL}",
    "coder-text-before-and-after": (
        f"{_STARTS_IN_REASONING}; and vLLM's non-streaming `qwen3_coder` drops the text after "
        "the call, which its streaming reading keeps; swerl returns all text outside the calls"
    ),
    "hermes-call-inside-reasoning": _IN_REASONING,
    "coder-call-inside-reasoning": (
        f"{_IN_REASONING} (vLLM's non-streaming reading also drops the content after it)"
    ),
    "hermes-bad-json": _STREAMS_BROKEN_CALL,
    "hermes-truncated-mid-call": _STREAMS_BROKEN_CALL,
    "hermes-good-then-bad": f"{_HERMES_BAD_CALL}; streamed, {_STREAMS_BROKEN_CALL}",
    "hermes-missing-closing-tag": (
        "vLLM's `hermes` reads an unclosed `<tool_call>` to the end of the reply "
        "(hermes_tool_parser.py:39, the second alternative) and runs it when that is whole JSON; "
        "swerl runs only a closed block, as SGLang does: a reply that stops without "
        "`</tool_call>` did not finish its call (a `malformed` call, or `truncated` when the "
        "token limit cut it), and the text stays content for the harness to show the model"
    ),
    "coder-missing-closing-tag": (
        "vLLM's `qwen3_coder` ends a call at `</function>` (vllm/parser/qwen3.py:172) and needs "
        "no `</tool_call>`; swerl runs only a closed block, as SGLang does, and keeps the text "
        "as content"
    ),
    "coder-truncated-mid-parameter": (
        "vLLM runs a call the reply ends inside: non-streaming with the parameters closed so "
        "far, streaming with the cut value too (vllm/parser/qwen3.py:77-84, `partial`); swerl "
        "never runs a call the reply ends inside (its error is `truncated` when the token limit "
        "cut it), so a cut edit is not applied half-written"
    ),
    "hermes-arguments-as-string": (
        'given `"arguments"` as a string holding JSON, vLLM encodes that string again '
        "(hermes_tool_parser.py:101), so a client is handed a JSON string, not an object; swerl "
        "decodes it once and hands over the object"
    ),
    "coder-no-function-tag": (
        "vLLM drops a block with no `<function=...>` (no call and no content); swerl keeps an "
        "unreadable block in the content (swerl/agent/gateway/parsing.py's rule), so what the "
        "model wrote is not lost from the conversation"
    ),
}


@dataclass(frozen=True)
class Reading:
    """One parser's reading of a reply, normalised for comparison: surrounding whitespace of the
    content and reasoning does not count (an empty one is None), arguments as parsed JSON."""

    content: str | None
    reasoning: str | None
    calls: tuple[tuple[str, Any], ...]
    error: str | None = None

    def brief(self) -> str:
        if self.error:
            return f"error: {self.error}"
        parts = []
        if self.reasoning is not None:
            parts.append(f"reasoning {_short(self.reasoning)}")
        if self.content is not None:
            parts.append(f"content {_short(self.content)}")
        for name, arguments in self.calls:
            parts.append(f"call {name}({_short(json.dumps(arguments, ensure_ascii=False))})")
        return "; ".join(parts) or "nothing"


def _short(text: str, limit: int = 48) -> str:
    flat = json.dumps(text, ensure_ascii=False)[1:-1]
    return f"`{flat[:limit]}…`" if len(flat) > limit else f"`{flat}`"


def _text(value: str | None) -> str | None:
    return value.strip() or None if value else None


def _arguments(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return {"<unparsed>": raw}


def load_cases() -> dict[str, Any]:
    corpus: dict[str, Any] = json.loads(CASES_PATH.read_text(encoding="utf-8"))
    return corpus


def swerl_reading(case: dict[str, Any], tools: list[dict[str, Any]]) -> Reading:
    parser = output_parser(
        SWERL_TOOL_PARSER[case["tool_call_parser"]],
        SWERL_REASONING_PARSER[case["reasoning_parser"]],
    )
    parsed = parser.parse(case["text"], tools)
    calls = tuple((call.name, call.arguments) for call in parsed.tool_calls)
    return Reading(_text(parsed.content), _text(parsed.reasoning), calls)


def vllm_reading(out: dict[str, Any]) -> Reading:
    if "error" in out:
        return Reading(None, None, (), error=out["error"])
    calls = tuple((call["name"], _arguments(call["arguments"])) for call in out["calls"])
    return Reading(_text(out["content"]), _text(out["reasoning"]), calls)


def run_vllm(python: str, corpus: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
    """Every case through vLLM's parsers, in one run of the driver under `python`."""
    job = {**corpus, "tokenizer": str(bundled_qwen3_tokenizer_dir())}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # nothing of swerl's environment leaks into vLLM's
    done = subprocess.run(
        [python, str(DRIVER_PATH)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the vLLM parser driver failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@dataclass(frozen=True)
class Row:
    case: dict[str, Any]
    swerl: Reading
    whole: Reading
    streamed: Reading

    @property
    def agrees(self) -> bool:
        return self.swerl == self.whole == self.streamed


def compare(corpus: dict[str, Any], vllm: dict[str, Any]) -> list[Row]:
    rows = []
    for case in corpus["cases"]:
        out = vllm["results"][case["id"]]
        rows.append(
            Row(
                case,
                swerl_reading(case, corpus["tools"]),
                vllm_reading(out["whole"]),
                vllm_reading(out["streamed"]),
            )
        )
    return rows


def render_table(rows: list[Row], vllm_version: str) -> str:
    agreeing = sum(row.agrees for row in rows)
    lines = [
        "# swerl's parsers beside vLLM's",
        "",
        "<!-- Written by scripts/parity-table (testkit/parser_parity.py); edit the corpus or the",
        "     documented differences there, not this file. -->",
        "",
        f"swerl's tool-call and reasoning parsers agree with vLLM {vllm_version}'s on **{agreeing} "
        f"of {len(rows)}** replies; every other one is a difference documented below, each with "
        "the reason swerl reads the reply as it does. tests/agent/test_vllm_parsers.py fails on a "
        "reply that differs and is not listed here, and on one listed that no longer differs.",
        "",
        "Parsers: Hermes-style `<tool_call>{json}</tool_call>` is swerl's `qwen25` beside vLLM's "
        "`hermes`; Qwen3-Coder's `<function=…><parameter=…>` is `qwen3_coder` in both; reasoning "
        "is `qwen3` in both (`none` / no `--reasoning-parser` where the table says so). swerl's "
        "reading is the model gateway's (`swerl.agent.gateway.parsing`: what a client is handed); "
        "vLLM's is its OpenAI server's (`vllm/parser/abstract_parser.py` `DelegatingParser.parse`, "
        "and `parse_delta` fed one token at a time for the streamed column). Surrounding "
        "whitespace of content and reasoning is not compared; arguments are compared as JSON.",
        "",
        "| case | reply | swerl | vLLM | streamed like whole | agrees |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        case = row.case
        parsers = f"{case['tool_call_parser']}/{case['reasoning_parser'] or 'none'}"
        streamed = "yes" if row.whole == row.streamed else f"no: {row.streamed.brief()}"
        lines.append(
            f"| `{case['id']}` ({parsers}) | {case['note']} | {row.swerl.brief()} "
            f"| {row.whole.brief()} | {streamed} "
            f"| {'yes' if row.agrees else '**no**'} |"
        )
    lines += ["", "## Documented differences", ""]
    for row in rows:
        if not row.agrees:
            reason = DIFFERENCES.get(row.case["id"], "**undocumented**")
            lines.append(f"- `{row.case['id']}`: {reason}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    python = os.environ.get("SWERL_VLLM_PYTHON", "")
    if not python:
        raise SystemExit("set SWERL_VLLM_PYTHON to the python of vLLM's environment")
    corpus = load_cases()
    vllm = run_vllm(python, corpus)
    TABLE_PATH.write_text(render_table(compare(corpus, vllm), vllm["vllm_version"]))
    print(f"wrote {TABLE_PATH.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
