"""A whole episode that runs into the engine's context length (issue 23 item 6): the replay
server refuses the over-long prompt with HTTP 400 as SGLang does (tokenizer_manager.py
`_validate_one_request`, or the scheduler's `validate_input_length` when its KV pool is the
smaller bound: issue 41 point 3), and the episode ends LIMIT_CONTEXT, graded, with its trajectory
of the turns before, never INFRA_ERROR. Real agent, pool, exec node and dockerd."""

from __future__ import annotations

import pytest
from testkit.agent import (
    agent_stack,
    bundled_tasks,
    check_record,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
)

from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks

CONTEXT_LENGTH = 3000
MAX_NEW = 256


@pytest.mark.usefixtures("base_image")
@pytest.mark.parametrize(
    "limit",
    [
        pytest.param({"context_length": CONTEXT_LENGTH}, id="tokenizer-manager"),
        # Issue 41 point 3: the scheduler's own bound (a KV pool smaller than the context).
        pytest.param({"max_req_input_len": CONTEXT_LENGTH - MAX_NEW}, id="scheduler"),
    ],
)
async def test_an_episode_past_the_engines_context_length_ends_limit_context_graded(
    limit: dict[str, int],
) -> None:
    task = bundled_tasks()[0]
    key = next(iter(scripts_for_tasks([task])))
    looks = [f"Looking.\n\n```bash\nseq {i} {i + 120}\n```" for i in range(20)]
    replay = ReplayPolicyServer({key: looks}, keep_requests=True, **limit)
    url = await replay.start()
    # The agent's own budget is far larger: only the engine's refusal can end the episode.
    start = start_for(task, url, "ctx", max_turns=20, max_context_tokens=32_000)
    start.limits.max_new_tokens = MAX_NEW
    try:
        async with agent_stack() as env:
            messages = await run_to_result(env.stub, start)
    finally:
        await replay.stop()
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_LIMIT_CONTEXT, result.error_message
    assert result.HasField("reward"), "a context limit is graded"
    assert result.error_reason == ""
    seen = replay.stats.requests_seen
    assert 1 <= len(seen) < 20, "the engine answered some turns, then refused"
    assert all(len(prompt) + MAX_NEW <= CONTEXT_LENGTH for prompt, _ in seen)
    check_record(result.trajectory, replay)
    assert sandboxes_left() == []
