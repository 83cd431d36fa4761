"""Blame on the real stack (issue 15 item 3): real dockerd, pool and exec node, the replay policy
and the real Qwen3 tokenizer. A policy that kills every process of its sandbox (its own shell
included) goes on with an observation that says so, and sees its files after the node started
the sandbox again; a policy that also removes what the container runs on ends SANDBOX_BROKEN
with reward -1, which the trainer plugin trains on, not INFRA_ERROR."""

from __future__ import annotations

import pytest
from testkit import slime_standin  # the framework stand-in of the plugin's own tests
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
from swerl.devservers.replay import ReplayPolicyServer, script_key, submit_turn
from swerl.trainer_plugin.convert import INFRA_ERROR, outcome_to_samples
from swerl.trainer_plugin.episode import EpisodeOutcome

pytestmark = pytest.mark.usefixtures("base_image")
COMMAND_TIMEOUT_S = 20.0


def _bash(command: str) -> str:
    return f"Running it.\n\n```bash\n{command}\n```"


async def _episode(episode_id: str, turns: list[str]):
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(
        {script_key(task.instance["problem_statement"]): turns}, keep_requests=True
    )
    url = await replay.start()
    try:
        async with agent_stack() as env:
            start = start_for(task, url, episode_id, command_timeout_s=COMMAND_TIMEOUT_S)
            messages = await run_to_result(env.stub, start)
    finally:
        await replay.stop()
    turns_seen = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    last_prompt = replay.tokenizer.decode(replay.stats.requests_seen[-1][0])
    return result_of(messages), turns_seen, last_prompt, replay


# A command that kills every process and then goes on is killed with the container (137). One
# that ends in the same instant as its kill may still get its own status out first (a race
# inside the container, see docs/shell-protocol.md N8): the commands below go on after the kill
# so that what the policy sees is the same on every run.
async def test_a_policy_that_kills_every_process_goes_on_and_sees_what_it_did():
    result, turns, prompt, replay = await _episode(
        "kill-all",
        [
            _bash("echo keep > /tmp/keep"),
            _bash("kill -9 -1; sleep 5"),
            _bash("cat /tmp/keep"),
            submit_turn(),
        ],
    )
    assert result.status == pb.EPISODE_STATUS_SUBMITTED, result.error_message
    # Nothing changed in the repository: graded like any empty submission.
    assert result.reward == -1.0 and result.report.error_reason == "EMPTY_PATCH"
    killer, after = turns[1], turns[2]
    assert (killer.exit_code, killer.timed_out) == (137, False)
    assert killer.exec_duration.seconds < COMMAND_TIMEOUT_S + 1
    assert (after.exit_code, after.output_head) == (0, "keep\n")
    # What the policy saw: its command was killed, then the sandbox had been started again.
    assert "killed by signal 9 (SIGKILL)" in prompt
    assert "it was started again before this command: files are kept" in prompt
    check_record(result.trajectory, replay)
    assert sandboxes_left() == []


async def test_a_policy_that_breaks_its_sandbox_for_good_ends_sandbox_broken_minus_one():
    # Without `sleep` the container cannot run again: the node cannot restart the sandbox.
    result, turns, _, replay = await _episode(
        "break-all",
        [
            _bash("rm -f /usr/bin/sleep /bin/sleep && kill -9 -1; tail -f /dev/null"),
            _bash("ls"),
            submit_turn(),
        ],
    )
    assert result.status == pb.EPISODE_STATUS_SANDBOX_BROKEN, (
        result.error_reason,
        result.error_message,
    )
    assert result.error_reason == "SANDBOX_BROKEN" and result.error_message
    assert result.reward == -1.0 and result.trajectory.reward == -1.0
    assert (turns[0].exit_code, turns[0].timed_out) == (137, False)
    check_record(result.trajectory, replay)
    outcome = EpisodeOutcome(episode_id=result.episode_id, address="test", result=result)
    template = slime_standin.Sample(
        group_index=0, index=0, prompt="p", label=None, metadata={"instance": {}}
    )
    sample = outcome_to_samples(template, outcome, per_turn=False)
    assert sample.metadata[INFRA_ERROR] is False and not sample.remove_sample
    assert sample.reward == -1.0
    assert sandboxes_left() == []
