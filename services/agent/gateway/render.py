"""Chat-template rendering of a session's calls: the whole conversation for a new root, and only
the messages after the model's recorded turn for a call that extends a chain.

The delta is what the template writes after an assistant turn: it renders a stand-in
conversation (system, user, an assistant turn holding a sentinel, then the new messages) and
keeps the text after the sentinel's end-of-turn, so the cost is the new messages' size, not the
history's. Both run in the agent's CPU pool (jinja holds the GIL; the tokenizer's batch encode
lets go of it).

A harness's turn adds the same kinds of message every time (a tool result, a user message), so
the template's output for them is kept per *shape* (the messages' roles and the names of their
fields) as text around slots, one per field the template writes: the next delta of that shape
is the slots filled with the new values (content, tool_call_id, ...), no jinja. A shape is
cached only when rendering it with three different sets of values (two sets of markers and one
with blank lines and edge whitespace) gave exactly the slots filled with them; a value holding a
marker the template may branch on (`<think>`, `<tool_response>`, their closings) is rendered by
the template. Before tokenizing, a render whose text alone proves it over the caller's limit
(more bytes than the limit times the longest token's bytes) is refused: tokenizing megabytes
to count them is seconds of CPU. Ids come from the
tokenizer's own Rust backend (the same ids as `encode`, without its Python layer; its batch
entry, which lets go of the GIL while it tokenizes), checked once per codec.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from swerl.agent.policy.tokens import ChatCodec, TemplateMismatch

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
# Three sets of probe values per (message, field): markers, markers with spaces, and blank lines
# with edge whitespace.
_PROBES: tuple[Callable[[int, str], str], ...] = (
    lambda i, key: f"SWERLSLOTa{i}{key}Q",
    lambda i, key: f"zz SWERLSLOTb{i}{key} zz",
    lambda i, key: f"\n  probe {i} {key}\n\n  line two \t\n",
)
_MAX_SHAPES = 256

# Per message: its role and the names of its other fields (all strings).
Shape = tuple[tuple[str, tuple[str, ...]], ...]
# A shape's delta text: the literal parts, and between each two the (message, field) slot.
Slots = tuple[list[str], list[tuple[int, str]]]


class OverBudget(Exception):
    """A render's text is longer than `limit` tokens could be: it holds at least `at_least`."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


def _longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token covers: the longest token as its backend
    decodes it alone (a partial character decodes to U+FFFD, three bytes, more than it holds),
    plus one for a decoder's joining space; else the longest vocabulary entry in UTF-8 (a
    byte-level or metaspace symbol is one byte of text but two or three here). 0: nothing to
    measure (no bound)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode_batch"):
        size = backend.get_vocab_size(with_added_tokens=True)
        texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    else:
        texts = list(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else []
    if not texts:
        return 0
    return max(len(str(text).encode("utf-8", "surrogatepass")) for text in texts) + 1


class _Fast:
    """Per codec: the content-slot texts of the delta shapes seen, and the raw encoder."""

    def __init__(self, codec: ChatCodec) -> None:
        self.lock = threading.Lock()
        self.tokenizer = codec.tokenizer
        self._token_bytes: int | None = None
        self.shapes: dict[Shape, Slots | None] = {}
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

    def token_bytes(self) -> int:
        """The longest token's bytes (measured on first need: ~0.1 s over a large vocab)."""
        if self._token_bytes is None:
            self._token_bytes = _longest_token_bytes(self.tokenizer)
        return self._token_bytes

    def check(self, text: str, limit: int) -> None:
        """Raise OverBudget when `text` cannot tokenize to fewer than `limit` tokens. Its
        character count bounds its bytes from below, so most texts need no measuring."""
        # A character is at most four bytes and a token at least one: such a text may fit.
        if limit <= 0 or len(text) * 4 <= limit:
            return
        per_token = self.token_bytes()
        if not per_token or len(text) * 4 <= limit * per_token:
            return
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if size > limit * per_token:
            raise OverBudget(-(-size // per_token))


_FAST: weakref.WeakKeyDictionary[ChatCodec, _Fast] = weakref.WeakKeyDictionary()
_FAST_LOCK = threading.Lock()


def _fast(codec: ChatCodec) -> _Fast:
    with _FAST_LOCK:
        fast = _FAST.get(codec)
        if fast is None:
            fast = _FAST[codec] = _Fast(codec)
        return fast


def _shape(messages: Sequence[Mapping[str, Any]]) -> Shape | None:
    """The messages' shape when each can take its fields from slots; None otherwise. Values are
    not part of it (a harness's every tool result has a new tool_call_id)."""
    shape = []
    for message in messages:
        role = message.get("role")
        if role not in _SLOT_ROLES or not isinstance(message.get("content"), str):
            return None
        names = []
        for key, value in message.items():
            # An empty value too goes to the template: it may leave out what an empty field
            # would have framed (`{% if message.name %}`), which the probes never show.
            if not isinstance(key, str) or not isinstance(value, str) or not value:
                return None
            if any(marker in value for marker in _MARKERS):
                return None
            if key != "role":
                names.append(key)
        shape.append((str(role), tuple(sorted(names))))
    return tuple(shape)


def _measure(texts: list[str], shape: Shape) -> Slots | None:
    """The slots of the first probe set's text, when filling them with each set's probes gives
    exactly that set's text; None otherwise (the template does not write the fields as they
    are, or writes one twice)."""
    keys = [(i, name) for i, (_, names) in enumerate(shape) for name in names]
    first = _PROBES[0]
    found = []
    for i, name in keys:
        at = texts[0].find(first(i, name))
        if at >= 0:
            found.append((at, i, name))
    found.sort()
    parts, slots, cursor = [], [], 0
    for at, i, name in found:
        if at < cursor:
            return None
        parts.append(texts[0][cursor:at])
        slots.append((i, name))
        cursor = at + len(first(i, name))
    parts.append(texts[0][cursor:])
    for probe, text in zip(_PROBES, texts, strict=True):
        if _fill(parts, [probe(i, name) for i, name in slots]) != text:
            return None
    return parts, slots


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
        limit: int = 0,
    ) -> list[int]:
        """The whole conversation with the generation header: a new root's prompt. With a
        `limit`, a text that cannot fit in that many tokens raises OverBudget untokenized."""
        text = self._apply(messages, tools)
        self._fast.check(text, limit)
        return self._encode(text)

    def _slots(self, shape: Shape, messages: Sequence[Mapping[str, Any]]) -> Slots | None:
        """The delta text of `shape` around its slots, measured on first use."""
        fast = self._fast
        with fast.lock:
            if shape in fast.shapes:
                return fast.shapes[shape]
        texts = []
        for probe in _PROBES:
            filled = [
                {"role": role, **{name: probe(i, name) for name in names}}
                for i, (role, names) in enumerate(shape)
            ]
            texts.append(self._apply([*_STAND_IN, *filled], None))
        slots = _measure(texts, shape)
        with fast.lock:
            if len(fast.shapes) < _MAX_SHAPES:
                fast.shapes[shape] = slots
        return slots

    def _delta_text(self, new_messages: Sequence[Mapping[str, Any]]) -> str:
        shape = _shape(new_messages) if self._slots_on else None
        slots = self._slots(shape, new_messages) if shape is not None else None
        if slots is None:
            return self._apply([*_STAND_IN, *new_messages], None)
        parts, where = slots
        return _fill(parts, [new_messages[i][name] for i, name in where])

    def delta(
        self, new_messages: Sequence[Mapping[str, Any]], output_ended: bool, limit: int = 0
    ) -> list[int]:
        """The ids the template puts after a recorded model turn: its end-of-turn (unless the
        sampled ids end with it), `new_messages`, and the generation header. `limit` as for
        `full` (the tokens left after the recorded chain)."""
        text = self._delta_text(new_messages)
        after = text.split(_SENTINEL, 1)[1]
        close = self.codec.close_text
        if not after.startswith(close):
            raise TemplateMismatch("the template does not close an assistant turn as measured")
        # One more: the end-of-turn the sampled ids may already hold is dropped from these.
        self._fast.check(after, limit + 1 if limit > 0 else 0)
        ids = self._encode(after)
        if output_ended and ids and ids[0] == self.end_of_turn_id:
            ids = ids[1:]
        return ids

    def measure(self) -> None:
        """Measure what the size bound needs now (the store does it off the calls' path)."""
        self._fast.token_bytes()

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
