"""Chat-template rendering of a session's calls: the whole conversation for a new root, and only
the messages after the model's recorded turn for a call that extends a chain.

The delta is what the template writes after an assistant turn: it renders a stand-in
conversation (system, user, an assistant turn holding a sentinel, then the new messages) and
keeps the text after the sentinel's end-of-turn, so the cost is the new messages' size, not the
history's. Both run in the agent's CPU pool (blocking: jinja and the tokenizer hold the GIL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from swerl.agent.tokens import ChatCodec, TemplateMismatch

_SENTINEL = "SWERL_GATEWAY_SENTINEL_9c1e"
_STAND_IN: list[dict[str, Any]] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": _SENTINEL},
]


class Renderer:
    """One policy's chat template, for the gateway's two kinds of render."""

    def __init__(self, codec: ChatCodec) -> None:
        self.codec = codec
        self.end_of_turn_id = codec.end_of_turn_id

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
        return self.codec.encode(self._apply(messages, tools))

    def delta(self, new_messages: Sequence[Mapping[str, Any]], output_ended: bool) -> list[int]:
        """The ids the template puts after a recorded model turn: its end-of-turn (unless the
        sampled ids end with it), `new_messages`, and the generation header."""
        text = self._apply([*_STAND_IN, *new_messages], None)
        after = text.split(_SENTINEL, 1)[1]
        close = self.codec.close_text
        if not after.startswith(close):
            raise TemplateMismatch("the template does not close an assistant turn as measured")
        ids = self.codec.encode(after)
        if output_ended and ids and ids[0] == self.end_of_turn_id:
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def count(self, text: str) -> int:
        return len(self.codec.encode(text))
