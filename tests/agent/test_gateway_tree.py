"""The session's call tree: a child's prompt is built from its parent's ids in one copy, and
recording a prompt that does not continue its parent at the seam is refused."""

from __future__ import annotations

from array import array

import pytest

from swerl.agent.gateway.tree import CallKind, CallNode, CallTree


def _record(
    tree: CallTree, parent: CallNode | None, prompt: array[int], out: list[int]
) -> CallNode:
    return tree.add(
        parent,
        protocol="openai",
        prompt_ids=prompt,
        output_ids=array("i", out),
        logprobs=array("d", [-0.5] * len(out)),
        finish_reason="stop",
        weight_version="",
        reused_tokens=parent.token_count() if parent is not None else 0,
        tool_calls=0,
        digest=None,
    )


def test_a_child_prompt_is_the_parents_prompt_and_sampled_ids_then_the_new_ids() -> None:
    tree = CallTree()
    root = _record(tree, None, array("i", range(100, 140)), [7, 8, 9])
    prompt = root.extended([1, 2, 3])
    assert prompt.tolist() == [*range(100, 140), 7, 8, 9, 1, 2, 3]
    # The parent's own arrays are not touched by its child's prompt.
    assert root.prompt_ids.tolist() == list(range(100, 140))
    assert root.output_ids.tolist() == [7, 8, 9]
    child = _record(tree, root, prompt, [4])
    assert child.kind is CallKind.EXTEND
    assert child.extended([]).tolist() == [*prompt.tolist(), 4]


@pytest.mark.parametrize(
    "prompt",
    [
        [*range(100, 140), 7, 8],  # shorter than the parent's tokens
        [*range(100, 140), 7, 9, 9, 1],  # a sampled id replaced
        [*range(101, 140), 7, 8, 9, 1],  # one id short before the sampled ones: shifted
    ],
)
def test_a_prompt_that_does_not_continue_its_parent_is_refused(prompt: list[int]) -> None:
    tree = CallTree()
    root = _record(tree, None, array("i", range(100, 140)), [7, 8, 9])
    with pytest.raises(AssertionError, match="does not extend"):
        _record(tree, root, array("i", prompt), [4])
    assert len(tree.calls) == 1
