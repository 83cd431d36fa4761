"""The hooks other than generate, their signatures, the settings, and import lightness."""

from __future__ import annotations

import argparse
import inspect
import math
import subprocess
import sys

import pytest
from testkit.plugin import accepted_estimators, make_args, make_sample

import swerl.trainer_plugin as plugin
from swerl.trainer_plugin import metrics
from swerl.trainer_plugin.settings import PluginSettings, plugin_settings

# -- signatures slime checks or calls by position/name ------------------------------------


def test_generate_has_the_parameter_names_slime_checks():
    params = list(inspect.signature(plugin.generate).parameters)
    assert params == ["args", "sample", "sampling_params", "evaluation"]
    assert inspect.signature(plugin.generate).parameters["evaluation"].default is False
    assert inspect.iscoroutinefunction(plugin.generate)


def test_reward_func_is_async_and_takes_a_sample_or_a_list_plus_kwargs():
    sig = inspect.signature(plugin.reward_func)
    assert list(sig.parameters)[:2] == ["args", "sample"]
    assert sig.parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    assert inspect.iscoroutinefunction(plugin.reward_func)


def test_sync_hooks_have_slimes_signatures():
    log = inspect.signature(plugin.log_rollout_data)
    assert list(log.parameters) == [
        "rollout_id",
        "args",
        "samples",
        "rollout_extra_metrics",
        "rollout_time",
    ]
    filt = inspect.signature(plugin.filter_infra_failures)
    assert list(filt.parameters)[:2] == ["args", "samples"]
    assert filt.parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    assert list(inspect.signature(plugin.post_process_rewards).parameters) == ["args", "samples"]
    eval_log = inspect.signature(plugin.log_eval_rollout_data)
    assert list(eval_log.parameters) == ["rollout_id", "args", "data", "extra_metrics"]
    for hook in (
        plugin.log_rollout_data,
        plugin.log_eval_rollout_data,
        plugin.filter_infra_failures,
        plugin.post_process_rewards,
    ):
        assert not inspect.iscoroutinefunction(hook)


def test_miles_generate_takes_miles_generate_fn_input():
    # miles' class-based rollout passes a GenerateFnInput to a generate function whose first
    # parameter is named `input`, and anything else through its legacy adapter (no state).
    assert list(inspect.signature(plugin.miles_generate).parameters) == ["input"]
    assert inspect.iscoroutinefunction(plugin.miles_generate)


def test_importing_the_plugin_imports_no_framework_docker_transformers_or_numpy():
    code = (
        "import sys, swerl.trainer_plugin;"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('slime', 'miles', 'docker', 'transformers', 'torch', 'tokenizers', 'swebench', 'ray',"
        " 'numpy')];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- reward_func ---------------------------------------------------------------------------


async def test_reward_func_answers_a_sample_with_a_value_and_a_list_with_a_list(fw):
    done = make_sample()
    done.reward = -1.0
    stored = make_sample()
    stored.metadata["reward"] = 1.0
    args = make_args(["127.0.0.1:1"])
    assert await plugin.reward_func(args, done) == -1.0
    assert await plugin.reward_func(args, [done, stored, make_sample()]) == [-1.0, 1.0, 0.0]


# -- dynamic-sampling filter -----------------------------------------------------------------


def _finished(fw, group_index, index, reward, *, rollout_id=None, **meta):
    sample = make_sample(group_index, index)
    sample.reward = reward
    sample.status = fw.Sample.Status.COMPLETED
    sample.rollout_id = rollout_id or f"ep-{group_index}-{index}"
    sample.metadata.update({"rollout_id": sample.rollout_id, "infra_error": False, **meta})
    return sample


def test_filter_keeps_a_clean_group_and_returns_slimes_own_output_type(fw):
    group = [_finished(fw, 0, i, float(i % 2)) for i in range(4)]
    out = fw.call_dynamic_filter(plugin.filter_infra_failures, None, group)
    assert isinstance(out, fw.DynamicFilterOutput)
    assert out.keep is True and out.reason is None


def test_filter_drops_a_group_holding_an_infra_placeholder(fw):
    group = [_finished(fw, 0, i, 1.0) for i in range(3)]
    broken = _finished(fw, 0, 3, 0.0, infra_error=True)
    broken.remove_sample = True
    out = fw.call_dynamic_filter(plugin.filter_infra_failures, None, [*group, broken])
    assert out.keep is False and out.reason == "swerl_infra_error"


def test_filter_flattens_per_turn_lists_and_drops_aborted_episodes(fw):
    clean = [[_finished(fw, 0, i, 1.0, rollout_id=f"e{i}") for _ in range(3)] for i in range(3)]
    aborted = [_finished(fw, 0, 3, 0.0, rollout_id="e3")]
    aborted[0].status = fw.Sample.Status.ABORTED
    assert plugin.filter_infra_failures(None, clean).keep is True
    out = plugin.filter_infra_failures(None, [*clean, aborted])
    assert out.keep is False and out.reason == "swerl_aborted"


def test_filter_works_without_slime_installed():
    from testkit.slime_standin import Sample

    sample = Sample(reward=1.0, status=Sample.Status.COMPLETED, metadata={"infra_error": True})
    out = plugin.filter_infra_failures(None, [sample])
    assert type(out).__name__ == "FallbackDynamicFilterOutput" and out.keep is False


# -- reward post-process ---------------------------------------------------------------------


def _grpo_args(**overrides):
    values = dict(
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
        n_samples_per_prompt=4,
        rollout_batch_size=2,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def _slime_default(rewards, n):
    """slime's own normalisation for one sample per episode: (r - mean) / (std + 1e-6)."""
    out = []
    for start in range(0, len(rewards), n):
        group = rewards[start : start + n]
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        out.extend((r - mean) / (std + 1e-6) for r in group)
    return out


def test_post_process_equals_slimes_default_with_one_sample_per_episode(fw):
    rewards = [1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    samples = [_finished(fw, i // 4, i % 4, r) for i, r in enumerate(rewards)]
    raw, normalised = plugin.post_process_rewards(_grpo_args(), samples)
    assert raw == rewards
    assert normalised == pytest.approx(_slime_default(rewards, 4))


def test_post_process_counts_every_episode_once_however_many_turns_it_has(fw):
    # Group 0: a 5-turn solved episode and three 1-turn failures. Counting turns would give a
    # mean of (5 - 3) / 8 = 0.25; counting episodes gives (1 - 3) / 4 = -0.5.
    solved = [_finished(fw, 0, 0, 1.0, rollout_id="win") for _ in range(5)]
    failed = [_finished(fw, 0, i, -1.0) for i in (1, 2, 3)]
    samples = [*solved, *failed]
    raw, normalised = plugin.post_process_rewards(_grpo_args(grpo_std_normalization=False), samples)
    assert len(raw) == len(normalised) == 8
    assert normalised == pytest.approx([1.5] * 5 + [-0.5] * 3)
    _, with_std = plugin.post_process_rewards(_grpo_args(), samples)
    std = math.sqrt((1.5**2 + 3 * 0.5**2) / 3)
    assert with_std == pytest.approx([1.5 / (std + 1e-6)] * 5 + [-0.5 / (std + 1e-6)] * 3)


def test_post_process_normalises_each_prompt_group_on_its_own(fw):
    samples = [_finished(fw, 0, i, r) for i, r in enumerate([1.0, 1.0, 1.0, -1.0])]
    samples += [_finished(fw, 1, i, r) for i, r in enumerate([-1.0, -1.0, -1.0, -1.0])]
    _, normalised = plugin.post_process_rewards(_grpo_args(grpo_std_normalization=False), samples)
    assert normalised == pytest.approx([0.5, 0.5, 0.5, -1.5, 0, 0, 0, 0])


def test_post_process_leaves_placeholders_out_of_the_statistics(fw):
    samples = [_finished(fw, 0, i, r) for i, r in enumerate([1.0, -1.0, 1.0])]
    placeholder = _finished(fw, 0, 3, 0.0, infra_error=True)
    placeholder.remove_sample = True
    raw, normalised = plugin.post_process_rewards(
        _grpo_args(grpo_std_normalization=False), [*samples, placeholder]
    )
    assert raw == [1.0, -1.0, 1.0, 0.0]
    assert normalised == pytest.approx([2 / 3, -4 / 3, 2 / 3, 0.0])


@pytest.mark.parametrize(
    "estimator", accepted_estimators(["grpo", "gspo", "cispo", "reinforce_plus_plus_baseline"])
)
@pytest.mark.parametrize("std_normalization", [True, False])
def test_post_process_equals_the_frameworks_own_for_every_estimator_it_normalises(
    fw, estimator, std_normalization
):
    # Two complete groups of four, one sample per episode: the framework's own post-process
    # (no hook) and the plugin's must agree value for value, whatever the estimator (miles
    # refuses cispo as an --advantage-estimator).
    rewards = [1.0, -1.0, -1.0, 0.0, 1.0, 1.0, -1.0, 1.0]
    samples = [_finished(fw, i // 4, i % 4, r) for i, r in enumerate(rewards)]
    args = _grpo_args(advantage_estimator=estimator, grpo_std_normalization=std_normalization)
    ours = plugin.post_process_rewards(args, samples)
    theirs = fw.default_post_process(args, samples)
    assert ours[0] == theirs[0] == rewards
    assert ours[1] == pytest.approx(theirs[1])
    if estimator not in fw.NORMALISED:
        assert ours[1] == rewards  # passed through raw, as the framework does
    else:
        divided = estimator in fw.STD_DIVIDED and std_normalization
        assert (ours[1][0] == pytest.approx(1.25)) is not divided  # centred: 1 - (-0.25)


@pytest.mark.parametrize(
    "overrides", [{"advantage_estimator": "ppo"}, {"rewards_normalization": False}]
)
def test_post_process_passes_raw_rewards_through_when_slime_would(fw, overrides):
    samples = [_finished(fw, 0, i, r) for i, r in enumerate([1.0, -1.0])]
    raw, rewards = plugin.post_process_rewards(_grpo_args(**overrides), samples)
    assert raw == rewards == [1.0, -1.0]


# -- rollout metrics ---------------------------------------------------------------------------


FULL = {
    "turns": 4.0,
    "tool_calls": 3.0,
    "model_query_time_sum": 2.0,
    "env_execution_time_sum": 1.0,
    "eval_time": 0.5,
    "agent_run_time": 3.5,
    "total_time": 4.5,
    "overhead_time": 0.5,
    "time_per_turn": 0.875,
    "model_query_time_avg": 0.5,
    "env_execution_time_avg": 0.33,
    "model_time_ratio": 0.44,
    "env_time_ratio": 0.22,
    "eval_time_ratio": 0.11,
}


def test_metrics_emit_every_seed_key_for_a_batch_of_episodes(fw):
    samples = [_finished(fw, 0, i, 1.0, agent_metrics=dict(FULL)) for i in range(3)]
    extra: dict = {}
    keep_default_logging = plugin.log_rollout_data(7, None, samples, extra, 12.0)
    assert keep_default_logging is False
    assert set(metrics.SEED_METRIC_KEYS) <= set(extra)
    assert extra["agent/turns_mean"] == 4.0 and extra["agent/turns_sum"] == 12.0
    assert extra["agent/total_time_max"] == 4.5 and extra["agent/episodes"] == 3.0


def test_metrics_skip_episodes_that_lack_a_key(fw):
    totals_only = {"eval_time": 42.0, "agent_run_time": 480.0, "total_time": 560.0}
    samples = [
        _finished(fw, 0, 0, 1.0, agent_metrics=dict(FULL)),
        _finished(fw, 0, 1, -1.0, agent_metrics=totals_only),
    ]
    out = metrics.agent_metrics(samples)
    assert out["agent/turns_mean"] == 4.0 and out["agent/turns_sum"] == 4.0
    assert out["agent/eval_time_mean"] == pytest.approx(21.25)
    assert out["agent/total_time_min"] == 4.5 and out["agent/total_time_max"] == 560.0
    only_totals = metrics.agent_metrics(samples[1:])
    assert "agent/turns_mean" not in only_totals and "agent/model_time_ratio" not in only_totals


def test_metrics_count_a_per_turn_episode_once(fw):
    one_episode = [
        _finished(fw, 0, 0, 1.0, rollout_id="ep", agent_metrics=dict(FULL)) for _ in range(4)
    ]
    other = _finished(fw, 0, 1, -1.0, agent_metrics={**FULL, "turns": 2.0})
    out = metrics.agent_metrics([one_episode, [other]])
    assert out["agent/turns_sum"] == 6.0 and out["agent/episodes"] == 2.0


def test_metrics_sum_the_tool_protocols_per_tool_counts_and_parse_failures(fw):
    tools = {"tool_calls": 5.0, "tool_calls_bash": 3.0, "tool_calls_submit": 1.0}
    samples = [
        _finished(fw, 0, 0, 1.0, agent_metrics={**FULL, **tools, "tool_parse_failures": 2.0}),
        _finished(fw, 0, 1, -1.0, agent_metrics={**FULL, "tool_calls_bash": 1.0}),
    ]
    out = metrics.agent_metrics(samples)
    assert out["agent/tool_calls_bash_sum"] == 4.0 and out["agent/tool_calls_bash_mean"] == 2.0
    assert out["agent/tool_calls_submit_sum"] == 1.0
    assert out["agent/tool_parse_failures_sum"] == 2.0
    assert "agent/format_errors_sum" not in out


def test_metrics_tell_infra_failures_from_unresolved_episodes(fw):
    samples = [
        _finished(fw, 0, 0, 1.0, episode_status="SUBMITTED", outcome_reward=1.0),
        _finished(fw, 0, 1, -1.0, episode_status="LIMIT_TURNS", outcome_reward=-1.0),
        _finished(fw, 0, 2, 0.0, episode_status="INFRA_ERROR", infra_error=True),
        _finished(fw, 0, 3, 0.0, episode_status="CANCELLED"),
    ]
    out = metrics.agent_metrics(samples)
    assert out["agent/infra_error_ratio"] == 0.25 and out["agent/aborted_ratio"] == 0.25
    assert out["agent/resolved_ratio"] == 0.5 and out["agent/truncated_ratio"] == 0.25


# -- settings ---------------------------------------------------------------------------------


def test_settings_come_from_env_and_custom_config_keys_win(monkeypatch):
    monkeypatch.setenv("SWERL_PLUGIN_AGENT_ADDRESSES", "10.0.0.1:18091, 10.0.0.2:18091")
    monkeypatch.setenv("SWERL_PLUGIN_DYNAMIC_HISTORY", "true")
    monkeypatch.setenv("SWERL_PLUGIN_PRM_COEF", "0.5")
    args = argparse.Namespace(swerl_prm_coef=0.25, swerl_max_turns=30, unrelated="x")
    settings = plugin_settings(args)
    assert settings.agent_addresses == ["10.0.0.1:18091", "10.0.0.2:18091"]
    assert settings.dynamic_history is True
    assert settings.prm_coef == 0.25 and settings.max_turns == 30
    assert plugin_settings(args) is settings, "computed once per args object"


def test_settings_reject_an_empty_address_list():
    with pytest.raises(ValueError, match="at least one"):
        PluginSettings(agent_addresses=" , ")
