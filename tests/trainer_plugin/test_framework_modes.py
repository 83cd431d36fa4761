"""The plugin under either framework and in every rollout mode a user can switch on: which
framework is used, the abort flag, the filter's output class, metrics without a metrics dict,
evaluation without infra noise, fully-async rollout, top-p and routing replay, and the reward
post-process against the framework's own formula for every estimator slime normalises.

Runs against the stand-in SWERL_TEST_FRAMEWORK names (conftest.py); CI runs both.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys

import numpy as np
import pytest
from testkit import miles_standin, slime_standin, standin_common
from testkit.playback import (
    EXPERTS_PER_TOKEN,
    PlaybackAgent,
    PlaybackServer,
    S,
    Scenario,
    eventually,
    playback_experts,
    playback_top_p,
    result,
)
from testkit.plugin import accepted_estimators, make_args, make_sample

import swerl.trainer_plugin as plugin
from swerl.trainer_plugin import framework
from swerl.trainer_plugin.hooks import PluginConfigError
from swerl.trainer_plugin.replay import RoutingReplayError

pytestmark = pytest.mark.usefixtures("fw")


def agent(scenario_for=lambda start: Scenario()) -> PlaybackServer:
    return PlaybackServer(PlaybackAgent(scenario_for))


def infra_error(start):
    return Scenario(
        result=result(start, S.EPISODE_STATUS_INFRA_ERROR, reward=None, error_reason="LEASE_LOST")
    )


# -- which framework ---------------------------------------------------------------------------


def test_the_installed_framework_is_found(fw):
    assert framework.find("auto") == fw.NAME


def test_an_explicit_framework_setting_wins_over_the_one_found(fw, monkeypatch):
    other = miles_standin if fw is slime_standin else slime_standin
    other.install(monkeypatch)  # both importable now
    monkeypatch.setenv("SWERL_PLUGIN_FRAMEWORK", fw.NAME)
    sample = make_sample()
    sample.status = sample.Status.COMPLETED
    out = plugin.filter_infra_failures(argparse.Namespace(), [sample])
    assert type(out) is fw.DynamicFilterOutput
    monkeypatch.setenv("SWERL_PLUGIN_FRAMEWORK", other.NAME)
    out = plugin.filter_infra_failures(argparse.Namespace(), [sample])
    assert type(out) is other.DynamicFilterOutput


def test_a_framework_setting_naming_an_absent_framework_is_refused(fw):
    absent = "miles" if fw.NAME == "slime" else "slime"
    with pytest.raises(framework.FrameworkError, match=absent):
        framework.find(absent)


# -- abort flag and filter under the framework's names -----------------------------------------


async def test_an_aborted_rollout_sends_cancel_and_its_group_is_dropped(fw, sampling_params):
    async with agent(lambda start: Scenario(wait_for_cancel=True)) as server:
        args = make_args([server.address])
        calls = [
            asyncio.ensure_future(fw.generate(args, make_sample(index=i), sampling_params))
            for i in range(4)
        ]
        await eventually(lambda: server.agent.active == 4)
        fw.abort(args)
        group = await asyncio.wait_for(asyncio.gather(*calls), 3.0)
        assert len(server.agent.cancels) == 4
    verdict = fw.filter_group(args, group)
    assert type(verdict) is fw.DynamicFilterOutput
    assert verdict.keep is False and verdict.reason == "swerl_aborted"


async def test_an_infra_failure_group_is_dropped_with_the_frameworks_own_output(
    fw, sampling_params
):
    async with agent(
        lambda start: infra_error(start) if start.episode_id.startswith("g0-s3") else Scenario()
    ) as server:
        args = make_args([server.address])
        group = await asyncio.gather(
            *(fw.generate(args, make_sample(index=i), sampling_params) for i in range(4))
        )
    verdict = fw.filter_group(args, group)
    assert type(verdict) is fw.DynamicFilterOutput
    assert verdict.keep is False and verdict.reason == "swerl_infra_error"
    assert fw.filter_group(args, group[:3]).keep is True


async def test_under_miles_class_rollout_the_slime_style_hook_is_refused_with_the_right_one(
    sampling_params, monkeypatch
):
    miles = only_miles(monkeypatch)
    async with agent() as server:
        args = make_args([server.address])
        args.custom_generate_function_path = "swerl.trainer_plugin.generate"
        with pytest.raises(PluginConfigError, match=re.escape("trainer_plugin.miles_generate")):
            await miles.generate(args, make_sample(standin=miles), sampling_params)
        assert server.agent.starts == [], "refused before any episode ran"
        # miles' legacy rollout keeps slime's singleton: the slime-style hook works there,
        # and sees the abort flag of that singleton.
        monkeypatch.setenv(miles.LEGACY_ENV, "1")
        out = await miles.generate(args, make_sample(standin=miles), sampling_params)
        miles.check_call_result(out, per_turn=False)
        waits = lambda start: Scenario(wait_for_cancel=True)  # noqa: E731
        server.agent.scenario_for = waits
        call = asyncio.ensure_future(miles.generate(args, make_sample(standin=miles), {}))
        await eventually(lambda: server.agent.active == 1)
        miles.abort(args)
        out = await asyncio.wait_for(call, 3.0)
    assert out.status is miles.Sample.Status.ABORTED and len(server.agent.cancels) == 1


def only_miles(monkeypatch):
    """miles' stand-in alone, as in a miles process (no slime modules imported)."""
    for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")]:
        monkeypatch.delitem(sys.modules, name)
    miles_standin.install(monkeypatch)
    monkeypatch.delenv(miles_standin.LEGACY_ENV, raising=False)
    return miles_standin


# -- metrics -----------------------------------------------------------------------------------


async def test_agent_metrics_are_logged_when_the_rollout_hands_no_metrics_dict(fw, sampling_params):
    async with agent() as server:
        args = make_args([server.address])
        samples = [await fw.generate(args, make_sample(index=i), sampling_params) for i in range(2)]
    logged = fw.log_rollout(args, 3, samples, {})
    assert logged["agent/episodes"] == 2.0 and logged["agent/turns_mean"] == 3.0
    standin_common.LOGGED.clear()
    # slime's fully-async rollout returns no metrics object: the hook gets None.
    fw.log_rollout(args, 3, samples, None)
    agent_logs = [m for key, m in standin_common.LOGGED if "agent/episodes" in m]
    assert len(agent_logs) == 1 and agent_logs[0]["rollout/step"] == 3
    assert agent_logs[0]["agent/turns_sum"] == 6.0


# -- evaluation ----------------------------------------------------------------------------------


async def test_eval_leaves_infra_failures_out_of_the_mean_and_counts_them(fw, sampling_params):
    rewards = {0: 1.0, 1: -1.0, 2: 1.0}  # sample 3 hits an infra failure

    def answer(start):
        index = int(start.episode_id.split("-s")[1].split("-")[0])
        if index == 3:
            return infra_error(start)
        return Scenario(result=result(start, reward=rewards[index]))

    async with agent(answer) as server:
        args = make_args([server.address], episode_attempts=1)  # no re-run: it still fails
        samples = await asyncio.gather(
            *(
                fw.generate(args, make_sample(index=i), sampling_params, evaluation=True)
                for i in range(4)
            )
        )
        owners = sorted(start.options.owner for start in server.agent.starts)
    # The data the eval rollout hands its logger: per dataset, rewards / truncation / samples.
    data = {
        "swe-verified": {
            "rewards": [s.reward for s in samples],
            "truncated": [False] * 4,
            "samples": list(samples),
        }
    }
    fw.log_eval(args, 5, data, None)
    (means,) = [m for _, m in standin_common.LOGGED if "eval/swe-verified" in m]
    assert means["eval/swe-verified"] == pytest.approx(1.0 / 3)
    (counts,) = [m for _, m in standin_common.LOGGED if "eval/swe-verified-infra_errors" in m]
    assert counts["eval/swe-verified-infra_errors"] == 1.0
    assert counts["eval/swe-verified-cancelled"] == 0.0 and counts["eval/step"] == 5
    assert owners == [f"{fw.NAME}/eval/eval/sample-{i}" for i in range(4)]


async def test_eval_owners_name_the_dataset_and_the_sample_index(fw, sampling_params):
    async with agent() as server:
        args = make_args([server.address])
        args.eval_datasets = [argparse.Namespace(name="swe-gym-val")]
        await fw.generate(args, make_sample(index=7), sampling_params, evaluation=True)
        sample = make_sample(index=2)
        sample.metadata["source_name"] = "swe-verified"  # an eval dataset's metadata_overrides
        await fw.generate(args, sample, sampling_params, evaluation=True)
        owners = [start.options.owner for start in server.agent.starts]
    # The prefix names the framework in use.
    assert owners == [
        f"{fw.NAME}/eval/swe-gym-val/sample-7",
        f"{fw.NAME}/eval/swe-verified/sample-2",
    ]


def test_an_eval_dataset_left_without_graded_episodes_reports_its_counts_only(fw):
    broken = make_sample()
    broken.reward = 0.0
    broken.metadata.update(infra_error=True)
    graded = make_sample(index=1)
    graded.reward = 1.0
    data = {
        "a": {"rewards": [0.0], "truncated": [False], "samples": [broken]},
        "b": {"rewards": [1.0], "truncated": [False], "samples": [graded]},
    }
    extra: dict = {}
    assert plugin.log_eval_rollout_data(0, make_args(["x:1"]), data, extra) is False
    assert list(data) == ["b"], "no mean over nothing"
    assert extra["eval/a-infra_errors"] == 1.0 and extra["eval/b-infra_errors"] == 0.0


# -- fully-async rollout -------------------------------------------------------------------------


async def test_slime_fully_async_with_dynamic_history_is_refused_at_the_first_generate(
    fw, sampling_params
):
    async with agent() as server:
        args = make_args([server.address], dynamic_history=True)
        args.rollout_function_path = (
            "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
        )
        if fw.NAME == "slime":
            with pytest.raises(PluginConfigError, match=r"fully-async.*swerl_dynamic_history"):
                await fw.generate(args, make_sample(), sampling_params)
            assert server.agent.starts == []
        # Whole trajectories go through it (one Sample per entry, as it sorts by .index).
        args = make_args([server.address])
        args.rollout_function_path = (
            "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
        )
        out = await fw.generate(args, make_sample(), sampling_params)
    fw.check_call_result(out, per_turn=False)


async def test_miles_fully_async_takes_dynamic_history(sampling_params, monkeypatch):
    miles = only_miles(monkeypatch)
    async with agent() as server:
        args = make_args([server.address], dynamic_history=True)
        args.fully_async = True  # miles filters and flattens per-turn lists in its data buffer
        out = await miles.generate(args, make_sample(standin=miles), sampling_params)
    miles.check_call_result(out, per_turn=True)


# -- top-p replay ----------------------------------------------------------------------------------


@pytest.mark.parametrize("per_turn", [False, True])
async def test_top_p_below_one_builds_train_data_with_the_policys_sets(fw, per_turn):
    def answer(start):
        if start.episode_id.startswith("g0-s3"):
            return infra_error(start)  # a placeholder must carry the fields too
        return Scenario()

    async with agent(answer) as server:
        args = make_args([server.address], dynamic_history=per_turn)
        args.rollout_top_p = 0.9
        params = fw.state(args).sampling_params
        group = await asyncio.gather(
            *(fw.generate(args, make_sample(index=i), dict(params)) for i in range(4))
        )
    samples = [s for out in group for s in (out if per_turn else [out])]
    if fw.NAME == "slime":
        assert params["custom_params"] == {"return_top_p_token_ids": True}
        for sample in samples:
            ids, offsets = sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets
            assert len(offsets) == sample.response_length + 1 and offsets[-1] == len(ids)
            if sample.remove_sample:
                assert ids == [] and set(offsets) == {0}
                continue
            response = sample.tokens[len(sample.tokens) - sample.response_length :]
            position = 0
            for i, (token, mask) in enumerate(zip(response, sample.loss_mask, strict=True)):
                kept = ids[offsets[i] : offsets[i + 1]]
                assert kept == (playback_top_p(position, token) if mask else [])
                position = position + 1 if mask else 0
    else:
        assert "custom_params" not in params, "miles has no top-p replay"
    data = fw.train_data(args, [list(group)])
    assert len(data["tokens"]) == len(samples)


# -- routing replay ----------------------------------------------------------------------------


def routing_replay_args(address: str, **plugin_settings):
    args = make_args([address], **plugin_settings)
    args.use_rollout_routing_replay = True
    args.num_layers, args.moe_router_topk = 2, 2
    return args


@pytest.mark.parametrize("per_turn", [False, True])
async def test_routing_replay_carries_the_routed_experts_into_train_data(
    fw, sampling_params, per_turn
):
    def answer(start):
        if start.episode_id.startswith("g0-s3"):
            return infra_error(start)
        return Scenario()

    async with agent(answer) as server:
        args = routing_replay_args(server.address, dynamic_history=per_turn)
        group = await asyncio.gather(
            *(fw.generate(args, make_sample(index=i), sampling_params) for i in range(4))
        )
        assert all(start.policy.return_routed_experts for start in server.agent.starts)
    samples = [s for out in group for s in (out if per_turn else [out])]
    for sample in samples:
        experts = np.asarray(sample.rollout_routed_experts)
        assert experts.shape == (len(sample.tokens) - 1, 2, 2)
        if not sample.remove_sample:
            for row, token in zip(experts, sample.tokens, strict=False):
                assert row.reshape(-1).tolist() == playback_experts(token)
    fw.train_data(args, [list(group)])


async def test_routing_replay_without_expert_data_fails_at_the_first_generate(fw, sampling_params):
    answer = lambda start: Scenario(result=result(start, with_replay=False))  # noqa: E731
    async with agent(answer) as server:
        args = routing_replay_args(server.address)
        with pytest.raises(RoutingReplayError, match="--use-rollout-routing-replay"):
            await fw.generate(args, make_sample(), sampling_params)


async def test_routing_replay_against_an_engine_without_expert_capture_fails_at_once(
    fw, sampling_params
):
    message = (
        "the episode asks for routed experts (PolicyConfig.return_routed_experts) but the policy"
        " reply has no meta_info.routed_experts"
    )

    def answer(start):
        status = S.EPISODE_STATUS_INFRA_ERROR
        bad_reply = result(start, status, reward=None, error_reason="POLICY_BAD_REPLY")
        bad_reply.error_message = message
        return Scenario(result=bad_reply)

    async with agent(answer) as server:
        args = routing_replay_args(server.address)
        with pytest.raises(RoutingReplayError, match="--use-rollout-routing-replay"):
            await fw.generate(args, make_sample(), sampling_params)


async def test_routing_replay_with_model_args_of_another_width_is_refused(fw, sampling_params):
    async with agent() as server:
        args = routing_replay_args(server.address)
        args.moe_router_topk = 4  # 2 x 4 = 8 values per token, the policy routes 4
        with pytest.raises(RoutingReplayError, match=f"{EXPERTS_PER_TOKEN} experts"):
            await fw.generate(args, make_sample(), sampling_params)


async def test_routing_replay_is_not_asked_for_in_evaluation(fw, sampling_params):
    async with agent(lambda start: Scenario(result=result(start, with_replay=False))) as server:
        args = routing_replay_args(server.address)
        out = await fw.generate(args, make_sample(), sampling_params, evaluation=True)
        assert not server.agent.starts[0].policy.return_routed_experts
    fw.check_call_result(out, per_turn=False)


# -- reward post-process against the framework's own formula --------------------------------


def _sample(fw, group_index, index, reward, *, rollout_id=None, **meta):
    sample = make_sample(group_index, index)
    sample.reward = reward
    sample.status = sample.Status.COMPLETED
    sample.rollout_id = rollout_id if rollout_id is not None else 100 * group_index + index
    sample.metadata.update({"rollout_id": sample.rollout_id, **meta})
    return sample


@pytest.mark.parametrize("estimator", accepted_estimators(slime_standin.NORMALISED))
@pytest.mark.parametrize("std", [True, False])
def test_post_process_equals_the_frameworks_formula_for_every_estimator(fw, estimator, std):
    # The framework in use decides: slime normalises cispo; miles has no cispo estimator.
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.25]
    samples = [_sample(fw, i // 4, i % 4, r) for i, r in enumerate(rewards)]
    args = make_args(["x:1"])
    args.advantage_estimator, args.grpo_std_normalization = estimator, std
    raw, ours = plugin.post_process_rewards(args, samples)
    _, frameworks = fw.default_post_process(args, samples)
    assert raw == rewards
    assert ours == pytest.approx(frameworks)
    if estimator not in fw.NORMALISED:
        assert ours == rewards
        return
    divided = estimator != "reinforce_plus_plus_baseline" and std
    centred_first = rewards[0] - sum(rewards[:4]) / 4
    assert math.isclose(ours[0], centred_first, rel_tol=1e-9) is (not divided)


@pytest.mark.parametrize("estimator", accepted_estimators(slime_standin.NORMALISED))
@pytest.mark.parametrize("std", [True, False])
def test_post_process_equals_the_frameworks_with_a_zero_std_group(fw, estimator, std):
    # Two complete groups of four (a layout both frameworks group alike); the first group's
    # rewards are all equal: std 0, so every value there is 0 (slime: 0 / (0 + 1e-6); miles
    # skips the division).
    rewards = [0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 0.25, 1.0]
    samples = [_sample(fw, i // 4, i % 4, r) for i, r in enumerate(rewards)]
    args = _post_process_args(estimator, std)
    raw, ours = plugin.post_process_rewards(args, samples)
    _, frameworks = fw.default_post_process(args, samples)
    assert raw == rewards
    assert ours == pytest.approx(frameworks, abs=1e-9)
    if estimator in fw.NORMALISED:
        assert ours[:4] == pytest.approx([0.0] * 4, abs=1e-9)


@pytest.mark.parametrize("estimator", accepted_estimators(slime_standin.NORMALISED))
@pytest.mark.parametrize("std", [True, False])
def test_post_process_with_a_one_member_group_and_uneven_groups(fw, estimator, std):
    # Groups of 1, 3 (std 0) and 4 samples, and a group of two episodes where one returned two
    # samples (dynamic history: one per turn, sharing the episode's rollout_id and reward).
    layout = [(0, 1.0), (1, 0.3), (1, 0.3), (1, 0.3), (2, 1.0), (2, 0.0), (2, 0.0), (2, 0.5)]
    samples = [_sample(fw, g, i, r) for i, (g, r) in enumerate(layout)]
    samples += [_sample(fw, 3, 8, 1.0, rollout_id=7), _sample(fw, 3, 9, 1.0, rollout_id=7)]
    samples += [_sample(fw, 3, 10, 0.0)]
    args = _post_process_args(estimator, std)
    raw, ours = plugin.post_process_rewards(args, samples)
    if estimator not in fw.NORMALISED:
        assert ours == raw
        return
    # The one-member group and the zero-std group: 0 (no spread to normalise).
    assert ours[:4] == pytest.approx([0.0] * 4, abs=1e-9)
    if fw.NAME == "miles":
        # miles groups by group_index and normalises one value per rollout: the plugin agrees.
        _, frameworks = fw.default_post_process(args, samples)
        assert ours == pytest.approx(frameworks, abs=1e-9)
        return
    # slime reshapes a batch of n_samples_per_prompt x rollout_batch_size rows and normalises
    # any other batch as one row (why the plugin has its own post-process). Over whole groups
    # of n = 1 it gives NaN where it divides by the std of one value; the plugin gives 0.
    args.n_samples_per_prompt, args.rollout_batch_size = 1, 3
    single = [_sample(fw, g, 0, r) for g, r in enumerate([1.0, 0.0, 0.5])]
    _, ours = plugin.post_process_rewards(args, single)
    _, frameworks = fw.default_post_process(args, single)
    assert ours == [0.0, 0.0, 0.0]
    divided = estimator in fw.STD_DIVIDED and std
    assert all(math.isnan(v) for v in frameworks) if divided else frameworks == ours


def _post_process_args(estimator: str, std: bool) -> argparse.Namespace:
    args = make_args(["x:1"])
    args.advantage_estimator, args.grpo_std_normalization = estimator, std
    return args


def test_get_reward_value_needs_reward_key_as_in_the_framework(fw):
    sample = make_sample()
    sample.reward = {"score": 1.0}
    with pytest.raises(AttributeError):
        sample.get_reward_value(argparse.Namespace())
    assert sample.get_reward_value(argparse.Namespace(reward_key="score")) == 1.0
