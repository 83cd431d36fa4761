"""Reasoning parsers, named as SGLang's `--reasoning-parser` values: they split a reply into its
reasoning block and the rest.

`qwen3` and `glm45`: reasoning is `<think>…</think>` at the start of the reply, when present. A
reply that carries `</think>` without `<think>` is read as reasoning too (newer Qwen3 templates
put `<think>` in the generation prompt, so the model never samples it). `qwen3-thinking` and
`deepseek-r1`: the reply always starts inside reasoning (the template opened it), so a reply with
no `</think>` is all reasoning, cut off."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: no reasoning block
    content: str  # everything after the reasoning block
    truncated: bool  # the reasoning block was never closed


@dataclass(frozen=True)
class ThinkReasoningParser:
    """`<think>`-style reasoning; `forced`: the reply starts inside the block."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    forced: bool = False

    def split(self, text: str) -> ReasoningSplit:
        head = text.lstrip()
        opened = head.startswith(self.start)
        if opened:
            body = head[len(self.start) :]
        elif self.forced or self.end in text:
            body = text
        else:
            return ReasoningSplit(None, text, False)
        reasoning, closed, rest = body.partition(self.end)
        if not closed:
            return ReasoningSplit(reasoning.strip(), "", True)
        return ReasoningSplit(reasoning.strip(), rest, False)


REASONING_PARSERS: dict[str, ThinkReasoningParser] = {
    "qwen3": ThinkReasoningParser("qwen3"),
    "qwen3-thinking": ThinkReasoningParser("qwen3-thinking", forced=True),
    "glm45": ThinkReasoningParser("glm45"),
    "deepseek-r1": ThinkReasoningParser("deepseek-r1", forced=True),
}
