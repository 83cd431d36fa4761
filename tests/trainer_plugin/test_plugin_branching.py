"""Branching rollouts in the plugin (`branch_at_turn`): the n generate calls of one prompt group
meet and share ONE RunEpisode with EpisodeOptions.branch, against a real grpc.aio AgentService
playing back branching episodes. Every returned sample is checked against the framework's
invariants; the group hooks (filter, reward post-process, train data) run over the results.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from testkit.playback import (
    PROMPT,
    PlaybackAgent,
    PlaybackServer,
    S,
    Scenario,
    branch_result,
    branch_turns,
    eventually,
    result,
)
from testkit.plugin import SAMPLING_PARAMS, make_args, make_sample

from swerl.trainer_plugin import filter_infra_failures, post_process_rewards
from swerl.trainer_plugin.metrics import flatten

pytestmark = pytest.mark.usefixtures("fw")

N = 4
AT_TURN = 2
REWARDS = [1.0, -1.0, 1.0, -1.0]


def agent(scenario_for=lambda start: Scenario()) -> PlaybackServer:
    return PlaybackServer(PlaybackAgent(scenario_for))


def branched(rewards=REWARDS, statuses=None, **kw):
    """Answers a branching start with one result per branch (rewards/statuses per branch, in
    reverse order of the branches, as results come in the order branches end)."""

    def answer(start):
        if not start.options.branch.count:
            return Scenario(**kw)
        results = []
        for b in reversed(range(start.options.branch.count)):
            status = statuses[b] if statuses else S.EPISODE_STATUS_SUBMITTED
            reward = None if status == S.EPISODE_STATUS_INFRA_ERROR else rewards[b]
            reason = "LEASE_LOST" if status == S.EPISODE_STATUS_INFRA_ERROR else ""
            results.append(branch_result(start, b, status, reward=reward, error_reason=reason))
        return Scenario(results=results, **kw)

    return answer


def group(fw, n=N, group_index=0):
    return [make_sample(group_index=group_index, index=group_index * n + i) for i in range(n)]


async def generate_group(fw, args, samples, evaluation=False):
    """The framework's generate_and_rm_group: every member's generate at once."""
    return await asyncio.gather(
        *(fw.generate(args, s, dict(SAMPLING_PARAMS), evaluation=evaluation) for s in samples)
    )


def response_of(sample):
    return sample.tokens[len(sample.tokens) - sample.response_length :]


def grpo(values):
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return [(v - mean) / (std + 1e-6) for v in values]


async def test_a_prompt_group_is_one_trunk_and_n_branches_with_a_shared_identical_prefix(fw):
    async with agent(branched()) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN)
        args.n_samples_per_prompt = N
        samples = group(fw)
        outs = await generate_group(fw, args, samples)
        (start,) = server.agent.starts  # ONE episode for the whole group

    assert start.options.branch.at_turn == AT_TURN and start.options.branch.count == N
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    trunk_turns = branch_turns(4, AT_TURN, 0)[:AT_TURN]
    shared = PROMPT + [t for turn in trunk_turns for t in turn.response + turn.observation]
    for i, sample in enumerate(got):
        # Member i (in index order) is branch i, with its own seed, the group's reward of it.
        assert sample.index == samples[i].index and sample.group_index == 0
        assert sample.metadata["branch"] == i
        assert sample.metadata["sampling_seed"] == 1000 + 1 + i
        assert sample.metadata["branch_at_turn"] == AT_TURN
        assert sample.metadata["branch_episode_id"] == start.episode_id
        assert sample.metadata["episode_id"] == f"{start.episode_id}.b{i}"
        assert sample.reward == REWARDS[i] and not sample.remove_sample
        # The shared prefix: identical tokens, masks and logprobs in every member.
        assert sample.tokens[: len(shared)] == shared
        n_trunk = len(shared) - len(PROMPT)
        assert sample.loss_mask[:n_trunk] == got[0].loss_mask[:n_trunk]
        assert sample.rollout_log_probs[:n_trunk] == got[0].rollout_log_probs[:n_trunk]
    # ... and the branches differ after it.
    assert len({tuple(response_of(s)) for s in got}) == N
    assert len({s.metadata["rollout_id"] for s in got}) == N and {s.rollout_id for s in got} == {
        None
    }
    # The group hooks: kept, and GRPO advantages over the group's n branches.
    assert fw.call_dynamic_filter(filter_infra_failures, args, got).keep
    raw, advantages = post_process_rewards(args, got)
    assert raw == REWARDS
    assert advantages == pytest.approx(grpo(REWARDS))
    # Exactly what the framework's own post-process gives a whole group of one-sample calls.
    args.rollout_batch_size = 1
    assert advantages == pytest.approx(fw.default_post_process(args, got)[1])
    data = fw.train_data(args, [got])
    assert data["rewards"] == pytest.approx(grpo(REWARDS))


async def test_dynamic_history_gives_every_member_its_own_copy_of_the_trunk_turns(fw):
    async with agent(branched()) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, dynamic_history=True)
        args.n_samples_per_prompt = N
        outs = await generate_group(fw, args, group(fw))
        (start,) = server.agent.starts
    assert start.options.dynamic_history and start.options.branch.count == N

    lists = [fw.check_call_result(out, per_turn=True) for out in outs]
    turn_indices = [[s.metadata["turn_index"] for s in samples] for samples in lists]
    # Every member: the trunk's 2 turns, then its own 2.
    assert turn_indices == [[0, 1, 2, 3]] * N
    for i, samples in enumerate(lists):
        assert [s.metadata["branch_trunk"] for s in samples] == [True, True, False, False]
        # Its own branch's reward on every turn, trunk copies included, on its own rollout_id.
        assert [s.reward for s in samples] == [REWARDS[i]] * 4
        assert {s.rollout_id for s in samples} == {samples[0].index}
        # The trunk copies are identical in every member; its own turns continue them exactly.
        for mine, first in zip(samples[:AT_TURN], lists[0][:AT_TURN], strict=True):
            assert mine.tokens == first.tokens and mine.loss_mask == first.loss_mask
            assert mine.rollout_log_probs == first.rollout_log_probs
        assert samples[AT_TURN].tokens[: len(samples[AT_TURN - 1].tokens)] == (
            samples[AT_TURN - 1].tokens
        )
    assert fw.call_dynamic_filter(filter_infra_failures, args, outs).keep
    flat = flatten(outs)
    _, advantages = post_process_rewards(args, flat)
    # Every turn of member i (trunk copies too): member i's advantage over the group's episodes.
    expected = grpo(REWARDS)
    by_sample = dict(zip((id(s) for s in flat), advantages, strict=True))
    for i, samples in enumerate(lists):
        for sample in samples:
            assert by_sample[id(sample)] == pytest.approx(expected[i], abs=1e-6)
    fw.train_data(args, outs)


def member_loss_weights(data, trunk_flags):
    """Per rollout_id: the loss weight the frameworks' reducer gives the rollout's trunk tokens
    and its own tokens (each token weighs mask / rollout_mask_sums, slime ray/rollout.py:685-700
    with backends/megatron_utils/cp_utils.py:73-80; miles train_data_conversion.py:162-169)."""
    weights = {}
    for rid, mask, denominator, trunk in zip(
        data["rollout_ids"], data["loss_masks"], data["rollout_mask_sums"], trunk_flags, strict=True
    ):
        entry = weights.setdefault(rid, {"trunk": 0.0, "own": 0.0})
        entry["trunk" if trunk else "own"] += sum(mask) / max(denominator, 1)
    return weights


async def test_every_member_of_a_branching_group_weighs_the_same_in_the_loss(fw):
    """The framework's per-rollout_id token mean gives every member of a branching group one
    weight, its trunk share and its own share alike in every member (a trunk carried by one
    member only put that member's own turns at a lower weight than the others')."""
    async with agent(branched()) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, dynamic_history=True)
        args.n_samples_per_prompt = N
        outs = await generate_group(fw, args, group(fw))
    flat = flatten(outs)
    data = fw.train_data(args, outs)
    weights = member_loss_weights(data, [s.metadata["branch_trunk"] for s in flat])
    assert len(weights) == N
    for entry in weights.values():
        assert entry["trunk"] + entry["own"] == pytest.approx(1.0)
        assert entry == pytest.approx(next(iter(weights.values())))
    # Equal-length branches: the trunk's 2 turns and the member's own 2 weigh 1/2 each.
    assert {round(e["own"], 6) for e in weights.values()} == {0.5}


async def test_a_trunk_that_fails_makes_every_member_an_infra_placeholder(fw):
    def answer(start):
        failed = result(
            start, S.EPISODE_STATUS_INFRA_ERROR, reward=None, error_reason="FORK_UNAVAILABLE"
        )
        return Scenario(result=failed)

    async with agent(answer) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, episode_attempts=1)
        outs = await generate_group(fw, args, group(fw))
        assert len(server.agent.starts) == 1
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    for sample in got:
        assert sample.remove_sample and sample.metadata["infra_error"]
        assert sample.metadata["error_reason"] == "FORK_UNAVAILABLE"
    assert not fw.call_dynamic_filter(filter_infra_failures, args, got).keep


async def test_a_failed_branch_makes_that_member_alone_a_placeholder(fw):
    statuses = [S.EPISODE_STATUS_SUBMITTED] * N
    statuses[2] = S.EPISODE_STATUS_INFRA_ERROR
    async with agent(branched(statuses=statuses)) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, episode_attempts=1)
        outs = await generate_group(fw, args, group(fw))
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    assert [s.remove_sample for s in got] == [False, False, True, False]
    assert got[2].metadata["error_reason"] == "LEASE_LOST" and got[2].metadata["branch"] == 2
    assert [s.reward for s in got] == [1.0, -1.0, 0.0, -1.0]
    # As for any infra failure in a group: the filter drops (resamples) the group.
    assert not fw.call_dynamic_filter(filter_infra_failures, args, got).keep


async def test_a_trunk_that_submits_before_the_fork_leaves_the_others_their_own_episodes(fw):
    def answer(start):
        if start.options.branch.count:  # the trunk submitted at turn 1, before turn 2
            return Scenario(result=result(start, n_turns=1, reward=1.0))
        return Scenario(result=result(start, reward=-1.0))

    async with agent(answer) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN)
        outs = await generate_group(fw, args, group(fw))
        starts = server.agent.starts
    assert [s.options.branch.count for s in starts] == [N, 0, 0, 0]
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    assert [s.reward for s in got] == [1.0, -1.0, -1.0, -1.0]
    assert got[0].metadata["branch"] is None and got[0].metadata["branch_at_turn"] == AT_TURN
    assert len({s.metadata["episode_id"] for s in got}) == N
    raw, advantages = post_process_rewards(args, got)
    assert advantages == pytest.approx(grpo(raw))


@pytest.mark.parametrize("per_turn", [False, True])
async def test_abort_cancels_the_one_stream_and_every_member_returns_promptly(fw, per_turn):
    async with agent(lambda start: Scenario(wait_for_cancel=True, gap_s=0.01)) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, dynamic_history=per_turn)
        calls = [
            asyncio.ensure_future(fw.generate(args, s, dict(SAMPLING_PARAMS))) for s in group(fw)
        ]
        await eventually(lambda: server.agent.active == 1)
        began = time.monotonic()
        fw.abort(args)
        outs = await asyncio.wait_for(asyncio.gather(*calls), 5.0)
        took = time.monotonic() - began
        assert len(server.agent.cancels) == 1 and len(server.agent.starts) == 1
    assert took < 2.0
    for out in outs:
        samples = fw.check_call_result(out, per_turn=per_turn)
        assert all(s.status is fw.Sample.Status.ABORTED and s.reward == 0.0 for s in samples)
    assert not fw.call_dynamic_filter(filter_infra_failures, args, outs).keep


async def test_abort_while_the_group_gathers_answers_the_waiting_members_at_once(fw):
    async with agent(branched()) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN)
        calls = [
            asyncio.ensure_future(fw.generate(args, s, dict(SAMPLING_PARAMS)))
            for s in group(fw)[:2]  # two of the four members have arrived
        ]
        await asyncio.sleep(0.1)
        fw.abort(args)
        outs = await asyncio.wait_for(asyncio.gather(*calls), 2.0)
        assert server.agent.starts == []
    for out in outs:
        (sample,) = fw.check_call_result(out, per_turn=False)
        assert sample.status is fw.Sample.Status.ABORTED and sample.remove_sample
        assert sample.metadata["error_reason"] == "ABORTED_BEFORE_START"


async def test_a_cancelled_member_leaves_and_the_last_one_leaving_cancels_the_stream(fw):
    async with agent(lambda start: Scenario(ignore_cancel=True)) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN)
        calls = [
            asyncio.ensure_future(fw.generate(args, s, dict(SAMPLING_PARAMS))) for s in group(fw)
        ]
        await eventually(lambda: server.agent.parked == 1)
        for call in calls[:-1]:
            call.cancel()
        await asyncio.sleep(0.3)
        assert server.agent.cancelled_calls == [], "the others' branches go on"
        assert not calls[-1].done()
        calls[-1].cancel()
        for call in calls:
            with pytest.raises(asyncio.CancelledError):
                await call
        await eventually(lambda: bool(server.agent.cancelled_calls))
        assert server.agent.cancelled_calls == [server.agent.starts[0].episode_id]


async def test_a_member_cancelled_after_the_start_does_not_stop_the_others(fw):
    async with agent(branched(delay_before_result_s=0.5)) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN)
        calls = [
            asyncio.ensure_future(fw.generate(args, s, dict(SAMPLING_PARAMS))) for s in group(fw)
        ]
        await eventually(lambda: server.agent.active == 1)
        calls[1].cancel()
        outs = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(outs[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        (sample,) = fw.check_call_result(outs[i], per_turn=False)
        assert sample.metadata["branch"] == i and sample.reward == REWARDS[i]


async def test_a_group_not_all_there_in_time_branches_with_those_present_and_late_ones_run_alone(
    fw,
):
    async with agent(branched()) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, branch_rendezvous_timeout_s=0.3)
        samples = group(fw)
        early = [
            asyncio.ensure_future(fw.generate(args, s, dict(SAMPLING_PARAMS))) for s in samples[:3]
        ]
        await eventually(lambda: len(server.agent.starts) == 1)
        late = await fw.generate(args, samples[3], dict(SAMPLING_PARAMS))
        outs = [*(await asyncio.gather(*early)), late]
        starts = server.agent.starts
    assert [s.options.branch.count for s in starts] == [3, 0]
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    assert [s.metadata.get("branch") for s in got] == [0, 1, 2, None]
    assert all(not s.remove_sample for s in got)


async def test_a_group_with_one_member_in_time_runs_it_unbranched(fw):
    async with agent(branched()) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, branch_rendezvous_timeout_s=0.1)
        out = await fw.generate(args, make_sample(), dict(SAMPLING_PARAMS))
        (start,) = server.agent.starts
    assert not start.options.HasField("branch")
    (sample,) = fw.check_call_result(out, per_turn=False)
    assert sample.reward == 1.0


async def test_evaluation_does_not_branch_unless_asked(fw):
    async with agent(branched()) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN)
        args.n_samples_per_eval_prompt = N
        samples = [make_sample(group_index=None, index=i) for i in range(N)]
        await generate_group(fw, args, samples, evaluation=True)
        assert [s.options.branch.count for s in server.agent.starts] == [0] * N
    async with agent(branched()) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, branch_in_eval=True)
        args.n_samples_per_eval_prompt = N
        outs = await generate_group(fw, args, samples, evaluation=True)
        (start,) = server.agent.starts
    assert start.options.branch.count == N and not start.options.dynamic_history
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    assert [s.metadata["branch"] for s in got] == list(range(N))


async def test_branching_is_off_by_default(fw):
    async with agent(branched()) as server:
        outs = await generate_group(fw, make_args([server.address]), group(fw))
        assert [s.options.HasField("branch") for s in server.agent.starts] == [False] * N
    for out in outs:
        fw.check_call_result(out, per_turn=False)


async def test_a_stream_ending_before_every_branch_reported_makes_the_missing_ones_placeholders(
    fw,
):
    def answer(start):
        return Scenario(results=[branch_result(start, 1), branch_result(start, 3, reward=-1.0)])

    async with agent(answer) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN, episode_attempts=1)
        outs = await generate_group(fw, args, group(fw))
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    assert [s.remove_sample for s in got] == [True, False, True, False]
    assert [s.reward for s in got] == [0.0, 1.0, 0.0, -1.0]
    for i in (0, 2):
        assert got[i].metadata["infra_error"] and got[i].metadata["branch"] == i
        assert got[i].metadata["error_reason"] == "STREAM_ENDED_WITHOUT_RESULT"
    assert not fw.call_dynamic_filter(filter_infra_failures, args, got).keep


async def test_a_trunk_cancelled_before_the_fork_gives_every_member_an_aborted_sample(fw):
    def answer(start):
        cancelled = result(start, S.EPISODE_STATUS_CANCELLED, n_turns=1, reward=None)
        return Scenario(result=cancelled)

    async with agent(answer) as server:
        args = make_args([server.address], branch_at_turn=AT_TURN)
        outs = await generate_group(fw, args, group(fw))
        assert len(server.agent.starts) == 1
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    assert all(s.status is fw.Sample.Status.ABORTED and s.reward == 0.0 for s in got)
    assert not got[0].remove_sample, "the first member keeps the trunk's partial trajectory"
    for sample in got[1:]:
        assert sample.remove_sample and not sample.metadata["infra_error"]
        assert sample.metadata["error_reason"] == "TRUNK_CANCELLED_BEFORE_FORK"
    assert not fw.call_dynamic_filter(filter_infra_failures, args, got).keep
