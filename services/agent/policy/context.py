"""Context management: the prompt of each turn within a token budget.

The prompt of turn k is the first prompt followed by the units of the earlier turns (see
tokens.py). When `prompt + max_new_tokens` would exceed the budget, whole turns are omitted from
the middle: the system and problem prompt stay, a head of the first turns (up to 30% of the room
for turns) stays for good, a tail of the latest turns (up to 70%) stays, and a user message says
how many turns were left out. The tail is cut back further than strictly needed (a coarse step),
so the following turns append to an unchanged prefix until the next cut; between cuts each prompt
extends the previous one, which keeps the policy server's prefix cache warm and the bookkeeping
O(new tokens) per turn.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swerl.agent.policy.tokens import Unit, token_array


class ContextExhausted(Exception):
    """Even the problem and the latest turn do not fit the budget."""


@dataclass(frozen=True)
class ContextPolicy:
    budget_tokens: int
    head_fraction: float = 0.3
    # After a cut the tail holds at most (1 - head_fraction - step_fraction) of the room, so
    # roughly step_fraction * room tokens of new turns fit before the next cut.
    step_fraction: float = 0.25


class ContextWindow:
    """Which turns the next prompt holds, and the prompt ids themselves, kept incrementally."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        header_ids: list[int],
        marker_ids: Callable[[int], list[int]],
        policy: ContextPolicy,
        history_ids: Callable[[Sequence[int]], Sequence[int]] | None = None,
    ) -> None:
        # Ids are int32 arrays (see tokens.py): appending, copying a prompt out and the
        # policy's prefix check are memcpy-speed, and the garbage collector never walks them.
        self._first = array("i", prompt_ids)
        self._header = header_ids
        self._marker_ids = marker_ids
        self.policy = policy
        # How an earlier response appears in later prompts (None: as sampled). The agent
        # config's `history_reasoning: drop` leaves its reasoning out, as Qwen3's template does
        # for turns before the last user message; such a prompt no longer extends the last one,
        # so the trajectory forks into chains there (tokens.py).
        self._history_ids = history_ids
        self._units: list[Unit] = []
        self._head_end: int | None = None  # units [0, head_end) kept for good once cut
        self._tail_start = 0  # first unit after the omitted range
        self._prompt = array("i", prompt_ids)
        self.trims = 0

    @property
    def omitted_turns(self) -> int:
        return 0 if self._head_end is None else self._tail_start - self._head_end

    def append(self, unit: Unit) -> None:
        """A finished turn (its response and delta) joins the prompt."""
        self._units.append(unit)
        self._prompt.extend(self._in_history(unit))
        self._prompt.extend(token_array(unit.delta_ids))

    def fits(self, max_new_tokens: int) -> bool:
        """Whether the next prompt is the current one as is (no cut needed)."""
        budget = self.policy.budget_tokens
        return budget <= 0 or len(self._prompt) + max_new_tokens <= budget

    def next_prompt(self, max_new_tokens: int) -> tuple[array, bool]:
        """The prompt of the next turn (a fresh int32 array) and whether it was trimmed just now.

        Raises ContextExhausted when nothing that keeps the latest turn fits.
        """
        if self.fits(max_new_tokens):
            return self._prompt[:], False
        self._cut(max_new_tokens)
        return self._prompt[:], True

    def _cut(self, max_new_tokens: int) -> None:
        units = self._units
        marker_len = len(self._marker_ids(len(units))) + len(self._header)
        room = self.policy.budget_tokens - max_new_tokens - len(self._first) - marker_len
        if room <= 0 or not units:
            raise ContextExhausted("the problem prompt alone does not fit the context budget")
        if self._head_end is None:
            head_room, used, head_end = self.policy.head_fraction * room, 0, 0
            while head_end < len(units) - 1 and used + len(units[head_end]) <= head_room:
                used += len(units[head_end])
                head_end += 1
            self._head_end = head_end
        head = self._head_end
        head_len = sum(len(u) for u in units[:head])
        tail_room = room - head_len
        tail_target = max(0.0, tail_room - self.policy.step_fraction * room)
        start, tail_len = len(units), 0
        while start > head and tail_len + len(units[start - 1]) <= tail_target:
            tail_len += len(units[start - 1])
            start -= 1
        # The boundary only moves forward, and at least one turn is omitted.
        start = max(start, head + 1, self._tail_start)
        # Without the slack of a coarse step, keep as much as strictly fits (the latest turn
        # at least).
        start = min(start, len(units) - 1)
        while True:
            self._tail_start = start
            self._rebuild()
            if len(self._prompt) + max_new_tokens <= self.policy.budget_tokens:
                break
            if start >= len(units) - 1:
                raise ContextExhausted("the latest turn alone does not fit the context budget")
            start += 1
        self.trims += 1

    def _rebuild(self) -> None:
        assert self._head_end is not None
        prompt = self._first[:]
        for unit in self._units[: self._head_end]:
            prompt.extend(self._in_history(unit))
            prompt.extend(token_array(unit.delta_ids))
        # Every unit (and the first prompt) ends with the assistant header: the marker, a user
        # message, goes before it.
        del prompt[len(prompt) - len(self._header) :]
        prompt.extend(self._marker_ids(self.omitted_turns))
        prompt.extend(self._header)
        for unit in self._units[self._tail_start :]:
            prompt.extend(self._in_history(unit))
            prompt.extend(token_array(unit.delta_ids))
        self._prompt = prompt

    def _in_history(self, unit: Unit) -> array:
        if self._history_ids is None:
            return token_array(unit.response_ids)
        return token_array(self._history_ids(unit.response_ids))
