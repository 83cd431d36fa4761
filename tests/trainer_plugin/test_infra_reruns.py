"""Infra re-runs (trainer_plugin/reruns.py): an episode that ends INFRA_ERROR (or whose stream
broke) inside its generate call runs again, bounded, with the same sampling params and seed, so
one infra failure no longer costs its prompt group. Against a real grpc.aio AgentService playing
back the failures, with the framework stand-in's filter, post-process, train data and logger.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter

import grpc
import pytest
from google.protobuf import json_format
from testkit.playback import (
    PLAYBACK_NODE,
    PlaybackAgent,
    PlaybackServer,
    S,
    Scenario,
    branch_result,
    eventually,
    result,
)
from testkit.plugin import SAMPLING_PARAMS, make_args, make_sample

from swerl.trainer_plugin import filter_infra_failures
from swerl.trainer_plugin.metrics import agent_metrics, flatten

pytestmark = pytest.mark.usefixtures("fw")

N = 4
PARAMS = {**SAMPLING_PARAMS, "sampling_seed": 4242}


def member_of(start) -> int:
    """The sample index of a start (episode ids read g<group>-s<index>-<hex>[-a<n>])."""
    return int(start.episode_id.split("-")[1].removeprefix("s"))


def infra(start, reason="LEASE_LOST", **scenario):
    return Scenario(
        result=result(start, S.EPISODE_STATUS_INFRA_ERROR, reward=None, error_reason=reason),
        **scenario,
    )


class FailingFirst:
    """Answers: member `failing`'s first `times` attempts end INFRA_ERROR, everything else
    submits (reward 1 for even members, -1 for odd)."""

    def __init__(self, failing: int, times: int) -> None:
        self.failing, self.times = failing, times
        self.seen: Counter[int] = Counter()

    def __call__(self, start):
        member = member_of(start)
        self.seen[member] += 1
        if member == self.failing and self.seen[member] <= self.times:
            return infra(start)
        return Scenario(result=result(start, reward=1.0 if member % 2 == 0 else -1.0))


async def run_group(fw, args, params=PARAMS):
    samples = [make_sample(group_index=0, index=i) for i in range(N)]
    return await asyncio.gather(*(fw.generate(args, s, dict(params)) for s in samples))


@pytest.mark.parametrize("per_turn", [False, True], ids=["whole-trajectory", "dynamic-history"])
async def test_a_member_failing_once_then_succeeding_keeps_its_group(fw, per_turn):
    answer = FailingFirst(failing=2, times=1)
    async with PlaybackServer(PlaybackAgent(answer)) as server:
        args = make_args([server.address], dynamic_history=per_turn)
        outs = await run_group(fw, args)
        starts = server.agent.starts
    # Five episodes: the group's four, and member 2 once more, under a new id.
    assert sorted(member_of(s) for s in starts) == [0, 1, 2, 2, 3]
    first, again = [s for s in starts if member_of(s) == 2]
    assert again.episode_id == f"{first.episode_id}-a2"
    # The same sampling params, seed included.
    assert json_format.MessageToDict(again.policy.sampling_params) == json_format.MessageToDict(
        first.policy.sampling_params
    )
    assert again.policy.sampling_params["sampling_seed"] == 4242
    # ... on another node than the failed attempt's, where the pool has room.
    assert not first.options.avoid_node_ids
    assert list(again.options.avoid_node_ids) == [PLAYBACK_NODE]
    lists = [fw.check_call_result(out, per_turn=per_turn) for out in outs]
    for i, samples in enumerate(lists):
        for sample in samples:
            assert not sample.remove_sample and not sample.metadata["infra_error"]
            assert sample.metadata["episode_attempts"] == (2 if i == 2 else 1)
            assert sample.metadata["rerun_reasons"] == (["LEASE_LOST"] if i == 2 else [])
    assert lists[2][0].metadata["episode_id"] == again.episode_id
    # The group survives the filter and trains.
    assert fw.call_dynamic_filter(filter_infra_failures, args, outs).keep
    fw.train_data(args, outs)
    logged = fw.log_rollout(args, 3, flatten(outs), {})
    assert logged is not None
    assert logged["agent/infra_reruns_sum"] == 1.0
    assert logged["agent/episode_attempts_mean"] == pytest.approx(5 / 4)
    assert logged["agent/infra_recovered_ratio"] == 1.0
    assert logged["agent/infra_error_ratio"] == 0.0


@pytest.mark.parametrize("attempts", [1, 2, 4])
async def test_a_member_failing_every_attempt_drops_its_group_after_its_bounded_attempts(
    fw, attempts
):
    answer = FailingFirst(failing=1, times=100)
    async with PlaybackServer(PlaybackAgent(answer)) as server:
        args = make_args([server.address], episode_attempts=attempts)
        outs = await run_group(fw, args)
        starts = server.agent.starts
    assert Counter(member_of(s) for s in starts) == {0: 1, 1: attempts, 2: 1, 3: 1}
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    assert got[1].remove_sample and got[1].metadata["infra_error"]
    assert got[1].metadata["episode_attempts"] == attempts
    assert got[1].metadata["rerun_reasons"] == ["LEASE_LOST"] * (attempts - 1)
    assert not fw.call_dynamic_filter(filter_infra_failures, args, got).keep
    found = agent_metrics(got)
    assert found["agent/infra_reruns_sum"] == attempts - 1
    if attempts > 1:
        assert found["agent/infra_recovered_ratio"] == 0.0
    else:
        assert "agent/infra_recovered_ratio" not in found


async def test_an_abort_during_a_rerun_cancels_it_and_runs_no_further_attempt(fw):
    def answer(start):
        if start.episode_id.endswith("-a2"):
            return Scenario(wait_for_cancel=True, gap_s=0.01)
        return infra(start)

    async with PlaybackServer(PlaybackAgent(answer)) as server:
        args = make_args([server.address], episode_attempts=5)
        call = asyncio.ensure_future(fw.generate(args, make_sample(index=0), dict(PARAMS)))
        await eventually(lambda: server.agent.active == 1 and len(server.agent.starts) == 2)
        fw.abort(args)
        out = await asyncio.wait_for(call, 10)
        starts = [s.episode_id for s in server.agent.starts]
        cancels = list(server.agent.cancels)
    assert len(starts) == 2 and cancels == [starts[1]]
    (sample,) = fw.check_call_result(out, per_turn=False)
    assert sample.status is fw.Sample.Status.ABORTED and not sample.metadata["infra_error"]
    assert sample.metadata["episode_attempts"] == 2
    assert sample.metadata["rerun_reasons"] == ["LEASE_LOST"]


async def test_an_abort_while_an_attempt_fails_starts_no_rerun(fw):
    async with PlaybackServer(
        PlaybackAgent(lambda start: infra(start, delay_before_result_s=0.3))
    ) as server:
        args = make_args([server.address], episode_attempts=5)
        call = asyncio.ensure_future(fw.generate(args, make_sample(index=0), dict(PARAMS)))
        await eventually(lambda: server.agent.active == 1)
        fw.abort(args)
        out = await asyncio.wait_for(call, 10)
        starts = len(server.agent.starts)
    assert starts == 1
    (sample,) = fw.check_call_result(out, per_turn=False)
    assert sample.metadata["episode_attempts"] == 1


async def test_a_broken_stream_is_rerun_and_a_refused_start_is_not(fw):
    def answer(start):
        if member_of(start) == 0 and not start.episode_id.endswith("-a2"):
            return Scenario(abort_code=grpc.StatusCode.UNAVAILABLE)  # after started + 2 turns
        if member_of(start) == 1:
            return Scenario(abort_code=grpc.StatusCode.INVALID_ARGUMENT, turns_before=0)
        return Scenario(result=result(start))

    async with PlaybackServer(PlaybackAgent(answer)) as server:
        args = make_args([server.address])
        outs = await asyncio.gather(
            *(fw.generate(args, make_sample(index=i), dict(PARAMS)) for i in range(2))
        )
        starts = Counter(member_of(s) for s in server.agent.starts)
    assert starts == {0: 2, 1: 1}
    broken, refused = (fw.check_call_result(out, per_turn=False)[0] for out in outs)
    assert not broken.remove_sample and broken.metadata["rerun_reasons"] == ["RPC_UNAVAILABLE"]
    assert refused.remove_sample and refused.metadata["error_reason"] == "RPC_INVALID_ARGUMENT"
    assert refused.metadata["episode_attempts"] == 1


# -- branching groups -----------------------------------------------------------------------


async def test_a_trunk_failing_before_the_fork_reruns_the_groups_episode_with_the_same_seeds(fw):
    """Without a seed of their own the branches' seeds derive from the episode id: the re-run
    pins the first attempt's base (crc32 of its id), so every branch samples as before."""
    count = Counter()

    def answer(start):
        count["starts"] += 1
        if count["starts"] == 1:
            return infra(start, "FORK_UNAVAILABLE")
        return Scenario(
            results=[branch_result(start, b) for b in reversed(range(start.options.branch.count))]
        )

    async with PlaybackServer(PlaybackAgent(answer)) as server:
        args = make_args([server.address], branch_at_turn=2)
        args.n_samples_per_prompt = N
        outs = await run_group(fw, args, SAMPLING_PARAMS)
        first, again = server.agent.starts
    assert again.options.branch.count == N and again.episode_id == f"{first.episode_id}-a2"
    assert "sampling_seed" not in first.policy.sampling_params
    assert list(again.options.avoid_node_ids) == [PLAYBACK_NODE]
    assert again.policy.sampling_params["sampling_seed"] == zlib.crc32(first.episode_id.encode())
    got = [fw.check_call_result(out, per_turn=False)[0] for out in outs]
    for i, sample in enumerate(got):
        assert not sample.remove_sample and sample.metadata["branch"] == i
        assert sample.metadata["branch_episode_id"] == again.episode_id
        assert sample.metadata["episode_attempts"] == 2
        assert sample.metadata["rerun_reasons"] == ["FORK_UNAVAILABLE"]
    assert fw.call_dynamic_filter(filter_infra_failures, args, got).keep


@pytest.mark.parametrize("per_turn", [False, True], ids=["whole-trajectory", "dynamic-history"])
async def test_a_branch_failing_after_the_fork_reruns_that_member_alone_with_its_seed(fw, per_turn):
    def answer(start):
        if not start.options.branch.count:
            return Scenario(result=result(start, reward=-1.0))
        results = [
            branch_result(
                start,
                b,
                S.EPISODE_STATUS_INFRA_ERROR if b == 1 else S.EPISODE_STATUS_SUBMITTED,
                reward=None if b == 1 else 1.0,
                error_reason="LEASE_LOST" if b == 1 else "",
            )
            for b in range(start.options.branch.count)
        ]
        return Scenario(results=results)

    async with PlaybackServer(PlaybackAgent(answer)) as server:
        args = make_args([server.address], branch_at_turn=2, dynamic_history=per_turn)
        args.n_samples_per_prompt = N
        outs = await run_group(fw, args, SAMPLING_PARAMS)
        starts = server.agent.starts
    group_start, alone = starts
    assert group_start.options.branch.count == N and not alone.options.branch.count
    assert member_of(alone) == 1 and alone.episode_id.endswith("-a2")
    assert list(alone.options.avoid_node_ids) == [PLAYBACK_NODE]
    # The branch's own seed (the playback reports 1000 + 1 + branch).
    assert alone.policy.sampling_params["sampling_seed"] == 1000 + 1 + 1
    lists = [fw.check_call_result(out, per_turn=per_turn) for out in outs]
    assert all(not s.remove_sample for samples in lists for s in samples)
    assert lists[1][-1].reward == -1.0 and lists[1][-1].metadata["episode_attempts"] == 2
    assert lists[1][-1].metadata["rerun_reasons"] == ["LEASE_LOST"]
    assert [samples[-1].metadata["episode_attempts"] for samples in lists] == [1, 2, 1, 1]
    assert fw.call_dynamic_filter(filter_infra_failures, args, outs).keep
    fw.train_data(args, outs)
