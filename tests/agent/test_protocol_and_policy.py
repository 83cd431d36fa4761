"""The agent protocol (bash blocks, submission, observations) and the SGLang reply parser."""

from __future__ import annotations

import gc
import json
from array import array

import aiohttp
import pytest

from swerl.agent.actions.bash_block import (
    parse_action,
    render_format_error,
    render_observation,
    submission,
)
from swerl.agent.config import load_config
from swerl.agent.errors import UnknownConfig
from swerl.agent.policy.clients import PolicyUnavailable, SglangPolicy, parse_generate_reply
from swerl.devservers.replay import ReplayPolicyServer


def test_exactly_one_bash_block_is_an_action() -> None:
    assert parse_action("Look.\n\n```bash\nls -la\n```").command == "ls -la"
    assert parse_action("no block at all").command is None
    two = parse_action("```bash\nls\n```\nand\n```bash\npwd\n```")
    assert two.command is None and two.n_blocks == 2
    assert parse_action("```python\nprint(1)\n```").command is None


def test_blocks_inside_the_reasoning_do_not_count() -> None:
    text = "<think>maybe ```bash\nrm -rf /\n```</think>\nSo:\n```bash\ngit status\n```"
    assert parse_action(text).command == "git status"


def test_submission_needs_the_sentinel_first_and_exit_zero() -> None:
    out = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\ndiff --git a/x b/x\n"
    assert submission(out, 0) == "diff --git a/x b/x\n"
    assert submission(out, 1) is None
    assert submission("hello\nCOMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n", 0) is None


def test_long_output_keeps_head_and_tail_with_an_elision_note() -> None:
    config = load_config()
    output = "A" * 6000 + "B" * 6000
    text = render_observation(
        config, exit_code=3, output=output, timed_out=False, timeout_s=180, turns_left=None
    )
    assert "<returncode>3</returncode>" in text and "2000 characters elided" in text
    assert "A" * 5000 in text and "B" * 5000 in text and "A" * 5001 not in text
    short = render_observation(
        config, exit_code=0, output="ok\n", timed_out=True, timeout_s=180, turns_left=2
    )
    assert "killed" in short and "2 turns left" in short
    assert "held\n2" in render_format_error(config, n_blocks=2, turns_left=10)


def test_unknown_config_names_are_refused() -> None:
    with pytest.raises(UnknownConfig):
        load_config("../etc/passwd")


def test_generate_reply_gives_exact_ids_logprobs_and_finish_reason() -> None:
    body = {
        "text": "hi",
        "meta_info": {
            "output_token_logprobs": [[-0.5, 11, None], [-1.25, 22, "x"]],
            "finish_reason": {"type": "length", "length": 2},
            "weight_version": "7",
            "prompt_tokens": 5,
        },
    }
    gen = parse_generate_reply(json.dumps(body).encode())
    assert gen.output_ids == [11, 22] and gen.logprobs == [-0.5, -1.25]
    assert gen.finish_reason == "length" and gen.weight_version == "7"
    abort = dict(body, meta_info=dict(body["meta_info"], finish_reason={"type": "abort"}))
    assert parse_generate_reply(json.dumps(abort).encode()).finish_reason == "abort"
    with pytest.raises(PolicyUnavailable):
        parse_generate_reply(json.dumps({"text": "no logprobs", "meta_info": {}}).encode())


def test_request_body_passes_sampling_params_through_and_sets_max_new_tokens() -> None:
    params = {"temperature": 0.7, "top_k": 20, "stop": ["</x>"], "max_new_tokens": 99}
    policy = SglangPolicy(None, "http://h:1", params, request_timeout_s=5)  # type: ignore[arg-type]
    first = json.loads(policy._body([1, 2, 3], 512))
    assert first == {
        "input_ids": [1, 2, 3],
        "sampling_params": {**params, "max_new_tokens": 512},
        "return_logprob": True,
    }
    assert json.loads(policy._body([1, 2, 3, 4], 512))["input_ids"] == [1, 2, 3, 4]
    assert json.loads(policy._body([9, 8], 512))["input_ids"] == [9, 8]  # after a trim
    assert params["max_new_tokens"] == 99  # the caller's dict is not touched


def test_request_body_is_the_same_for_lists_and_int32_arrays() -> None:
    policy = SglangPolicy(None, "http://h:1", {}, request_timeout_s=5)  # type: ignore[arg-type]
    from_list = SglangPolicy(None, "http://h:1", {}, request_timeout_s=5)  # type: ignore[arg-type]
    prompts = [[5, 6, 7], [5, 6, 7, 70_000, 8], [5, 9]]
    for ids in prompts:
        assert policy._body(array("i", ids), 64) == from_list._body(ids, 64)


def test_request_bodies_of_extended_repeated_trimmed_and_reseeded_prompts_carry_exact_ids() -> None:
    # Each body reuses the JSON pieces of the prompt sent before when the new prompt extends it;
    # every body's ids must still be exactly its prompt, whatever came before.
    policy = SglangPolicy(None, "http://h:1", {}, request_timeout_s=5)  # type: ignore[arg-type]
    prompts = [
        [1],
        [1, 2, 3],
        [1, 2, 3],  # the same prompt again
        [1, 2, 3, 40, 50],
        [1, 2, 3, 40, 50, 6],
        [],
        [7, 8],  # after an empty one
        [1, 2, 3, 40, 50, 6, 7],  # not an extension of the last prompt
        [1, 2],  # a trimmed one
    ]
    for ids in prompts:
        assert json.loads(policy._body(array("i", ids), 8))["input_ids"] == ids
    twin = policy.reseeded(3)  # shares the sent pieces, then each goes its own way
    assert json.loads(twin._body([1, 2, 5], 8))["input_ids"] == [1, 2, 5]
    assert json.loads(policy._body([1, 2, 4], 8))["input_ids"] == [1, 2, 4]
    assert json.loads(twin._body([1, 2, 5, 6], 8))["input_ids"] == [1, 2, 5, 6]


async def test_policy_calls_leave_no_reference_cycles_behind() -> None:
    # Garbage in cycles is freed only by the cyclic collector, whose pauses stall the agent's
    # event loop: a turn must leave none (tenacity's state, once copied per call, did).
    replay = ReplayPolicyServer({})
    url = await replay.start()
    try:
        async with aiohttp.ClientSession() as session:
            policy = SglangPolicy(session, url, {}, request_timeout_s=30)
            await policy.generate(array("i", [1, 2, 3]), 8)  # first-call imports and caches
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for n in range(4, 8):
                    await policy.generate(array("i", range(1, n)), 8)
                gc.collect()
                left = list(gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
    finally:
        await replay.stop()
    assert left == []
