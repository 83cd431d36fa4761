"""Context management: whole turns out of the middle, head kept, tail cut in coarse steps."""

from __future__ import annotations

import itertools

import pytest

from swerl.agent.policy.context import ContextExhausted, ContextPolicy, ContextWindow
from swerl.agent.policy.tokens import Unit

HEADER = [900, 901]
FIRST = [1, 2, 3, *HEADER]


def _marker(n: int) -> list[int]:
    return [800, n, 801]


def _unit(i: int, size: int = 100) -> Unit:
    body = [10_000 + i] * (size - 1 - len(HEADER))
    return Unit(response_ids=[20_000 + i], logprobs=[-0.1], delta_ids=[*body, *HEADER])


def _window(budget: int) -> ContextWindow:
    return ContextWindow(list(FIRST), HEADER, _marker, ContextPolicy(budget))


def _next_prompt(window: ContextWindow, max_new_tokens: int) -> tuple[list[int], bool]:
    prompt, trimmed = window.next_prompt(max_new_tokens)  # an int32 array
    return prompt.tolist(), trimmed


def _turns_in(prompt: list[int]) -> list[int]:
    return [t - 20_000 for t in prompt if 20_000 <= t < 30_000]


def test_prompt_is_untouched_while_it_fits() -> None:
    window = _window(10_000)
    for i in range(5):
        window.append(_unit(i))
    prompt, trimmed = _next_prompt(window, 100)
    assert not trimmed and _turns_in(prompt) == [0, 1, 2, 3, 4]
    assert prompt[: len(FIRST)] == FIRST


def test_trimming_keeps_problem_head_and_tail_of_whole_turns_with_a_marker() -> None:
    window = _window(2_000)
    prompts = []
    for i in range(40):
        window.append(_unit(i))
        prompt, _ = _next_prompt(window, 200)
        assert len(prompt) + 200 <= 2_000
        assert prompt[: len(FIRST) - len(HEADER)] == FIRST[: -len(HEADER)]
        assert prompt[-len(HEADER) :] == HEADER
        prompts.append(prompt)
    turns = _turns_in(prompts[-1])
    head = [t for t in turns if t < 10]
    assert head == list(range(len(head))) and head  # the first turns stay
    assert turns[-1] == 39 and turns == sorted(turns)
    assert 800 in prompts[-1] and window.omitted_turns == 40 - len(turns)
    # Coarse steps: far fewer cuts than turns, and between cuts each prompt extends the last.
    assert window.trims <= 8
    extended = sum(1 for a, b in itertools.pairwise(prompts) if b[: len(a)] == a)
    assert extended >= len(prompts) - 1 - window.trims


def test_a_turn_larger_than_the_budget_ends_the_context() -> None:
    window = _window(1_000)
    window.append(_unit(0, size=100))
    window.append(_unit(1, size=2_000))
    with pytest.raises(ContextExhausted):
        window.next_prompt(100)


def test_problem_prompt_larger_than_budget_ends_the_context() -> None:
    window = _window(4)
    window.append(_unit(0))
    with pytest.raises(ContextExhausted):
        window.next_prompt(1)


def test_a_returned_prompt_is_a_copy_later_turns_leave_alone() -> None:
    window = _window(10_000)
    window.append(_unit(0))
    prompt, _ = window.next_prompt(100)
    before = prompt.tolist()
    window.append(_unit(1))
    later, _ = window.next_prompt(100)
    assert prompt.tolist() == before and later.tolist()[: len(before)] == before
    assert len(later) == len(before) + len(_unit(1))
