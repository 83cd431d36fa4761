"""Chat-template rendering of a session's calls: the whole conversation for a new root, and only
the messages after the model's recorded turn for a call that extends a chain.

The delta is what the template writes after an assistant turn: it renders a stand-in
conversation (system, user, an assistant turn holding a sentinel, then the new messages) and
keeps the text after the sentinel's end-of-turn, so the cost is the new messages' size, not the
history's. Both run in the agent's CPU pool (jinja holds the GIL; the tokenizer's batch encode
lets go of it).

A harness's turn adds the same kinds of message every time (a tool result, a user message), so
the template's output for them is kept per *shape* (the messages' roles and fields other than
their content) as text around content slots: the next delta of that shape is the slots filled
with the new contents, no jinja. A shape is cached only when rendering it with three different
sets of contents (two sets of markers and one with blank lines and edge whitespace) gave
exactly the slots filled with them; a content holding a marker the template may branch on
(`<think>`, `<tool_response>`, their closings) is rendered by the template. Ids come from the
tokenizer's own Rust backend (the same ids as `encode`, without its Python layer; its batch
entry, which lets go of the GIL while it tokenizes), checked once per codec.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from swerl.agent.tokens import ChatCodec, TemplateMismatch

_SENTINEL = "SWERL_GATEWAY_SENTINEL_9c1e"
_STAND_IN: list[dict[str, Any]] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": _SENTINEL},
]
# Roles whose content a template writes as it is (checked per shape before it is cached).
_SLOT_ROLES = frozenset({"tool", "user"})
# Content a template may branch on (Qwen3's reads `<tool_response>` on user messages and
# `</think>` on assistant ones): such a message is rendered by the template.
_MARKERS = ("<think>", "</think>", "<tool_response>", "</tool_response>")
_PROBES = (
    lambda i: f"SWERLSLOTa{i}Q",
    lambda i: f"zz SWERLSLOTb{i} zz",
    lambda i: f"\n  probe {i}\n\n  line two \t\n",
)
_MAX_SHAPES = 256

Shape = tuple[tuple[tuple[str, str], ...], ...]


class _Fast:
    """Per codec: the content-slot texts of the delta shapes seen, and the raw encoder."""

    def __init__(self, codec: ChatCodec) -> None:
        self.lock = threading.Lock()
        self.shapes: dict[Shape, list[str] | None] = {}
        self.encode: Callable[[str], list[int]] = codec.encode
        backend = getattr(codec.tokenizer, "_tokenizer", None)
        # encode_batch, not encode: the backend's single encode holds the GIL for the whole
        # tokenization (the event loop stalls that long, measured), its batch releases it. A
        # batch of one gains nothing from the backend's thread pool, and handing it there cost
        # 1.7 ms of wall time per 460 tokens on a loaded machine (2.79 ms against 1.11 ms without):
        # a process serving the gateway tokenizes on the calling thread unless the operator said
        # otherwise (TOKENIZERS_PARALLELISM is read at each call; swerl batches nothing larger).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        raw = getattr(backend, "encode_batch", None)
        if raw is not None:
            probe = "<|im_end|>\n<|im_start|>user\n<tool_response>\nx = 1  # ü 中文\n\n"
            try:
                same = list(raw([probe], add_special_tokens=False)[0].ids) == codec.encode(probe)
            except (TypeError, AttributeError, ValueError, IndexError):
                same = False
            if same:
                self.encode = lambda text: raw([text], add_special_tokens=False)[0].ids


_FAST: weakref.WeakKeyDictionary[ChatCodec, _Fast] = weakref.WeakKeyDictionary()
_FAST_LOCK = threading.Lock()


def _fast(codec: ChatCodec) -> _Fast:
    with _FAST_LOCK:
        fast = _FAST.get(codec)
        if fast is None:
            fast = _FAST[codec] = _Fast(codec)
        return fast


def _shape(messages: Sequence[Mapping[str, Any]]) -> Shape | None:
    """The messages' shape when each can take its content from a slot; None otherwise."""
    shape = []
    for message in messages:
        content = message.get("content")
        if message.get("role") not in _SLOT_ROLES or not isinstance(content, str):
            return None
        if any(marker in content for marker in _MARKERS):
            return None
        fields = []
        for key, value in message.items():
            if key == "content":
                continue
            if not isinstance(value, str):
                return None
            fields.append((key, value))
        shape.append(tuple(sorted(fields)))
    return tuple(shape)


class Renderer:
    """One policy's chat template, for the gateway's two kinds of render."""

    def __init__(self, codec: ChatCodec, *, slots: bool = True) -> None:
        """`slots=False` renders every delta with the template and encodes with the tokenizer's
        Python `encode` (the benchmark's baseline, what every call did before the slots)."""
        self.codec = codec
        self.end_of_turn_id = codec.end_of_turn_id
        self._fast = _fast(codec)
        self._slots_on = slots
        self._encode = self._fast.encode if slots else codec.encode

    def _apply(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> str:
        kwargs = dict(self.codec.template_kwargs)
        if tools:
            kwargs["tools"] = list(tools)
        text: str = self.codec.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, **kwargs
        )
        return text

    def full(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> list[int]:
        """The whole conversation with the generation header: a new root's prompt."""
        return self._encode(self._apply(messages, tools))

    def _slots(self, shape: Shape, messages: Sequence[Mapping[str, Any]]) -> list[str] | None:
        """The delta text of `shape` around its content slots, measured on first use."""
        fast = self._fast
        with fast.lock:
            if shape in fast.shapes:
                return fast.shapes[shape]
        texts = []
        for probe in _PROBES:
            filled = [{**m, "content": probe(i)} for i, m in enumerate(messages)]
            texts.append(self._apply([*_STAND_IN, *filled], None))
        first = _PROBES[0]
        parts: list[str] | None = []
        rest = texts[0]
        for i in range(len(messages)):
            head, found, rest = rest.partition(first(i))
            if not found or parts is None:
                parts = None
                break
            parts.append(head)
        if parts is not None:
            parts.append(rest)
            for probe, text in zip(_PROBES, texts, strict=True):
                contents = [probe(i) for i in range(len(messages))]
                if _fill(parts, contents) != text:
                    parts = None
                    break
        with fast.lock:
            if len(fast.shapes) < _MAX_SHAPES:
                fast.shapes[shape] = parts
        return parts

    def _delta_text(self, new_messages: Sequence[Mapping[str, Any]]) -> str:
        shape = _shape(new_messages) if self._slots_on else None
        parts = self._slots(shape, new_messages) if shape is not None else None
        if parts is None:
            return self._apply([*_STAND_IN, *new_messages], None)
        return _fill(parts, [m["content"] for m in new_messages])

    def delta(self, new_messages: Sequence[Mapping[str, Any]], output_ended: bool) -> list[int]:
        """The ids the template puts after a recorded model turn: its end-of-turn (unless the
        sampled ids end with it), `new_messages`, and the generation header."""
        text = self._delta_text(new_messages)
        after = text.split(_SENTINEL, 1)[1]
        close = self.codec.close_text
        if not after.startswith(close):
            raise TemplateMismatch("the template does not close an assistant turn as measured")
        ids = self._encode(after)
        if output_ended and ids and ids[0] == self.end_of_turn_id:
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def count(self, text: str) -> int:
        return len(self._encode(text))


def _fill(parts: list[str], contents: Sequence[str]) -> str:
    out = [parts[0]]
    for content, part in zip(contents, parts[1:], strict=True):
        out.append(content)
        out.append(part)
    return "".join(out)
