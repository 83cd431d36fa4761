"""The plugin's deadline on one generate call against the agent's own bound on the episode.

The agent holds an episode at most its wait for a sandbox + the episode's limits + the grading's
overhead (`swerl.agent.budget.client_deadline`, the one answer the plugin and `swerl eval` both
use). A plugin deadline inside that bound gives up on episodes the agent still runs, so the
plugin's default is that bound plus a margin, and a configured deadline not above it is refused
when the settings are read, with both numbers and the bound's parts in the message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from testkit.plugin import make_args

from swerl.agent import budget
from swerl.agent.config import load_config
from swerl.evaluation.runner import EvalConfig
from swerl.trainer_plugin.settings import PluginSettings, settings_from_args

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = [
    {},
    {"eval_timeout_s": 600},
    {"wall_timeout_s": 1800, "eval_timeout_s": 1800},
    {"harness": "mini-swe-agent", "wall_timeout_s": 1200, "eval_timeout_s": 300},
    {"harness": "builtin", "eval_timeout_s": 10},
    {"config_name": "tools", "max_turns": 20},
    {"config_name": "not-in-this-install"},
    {"agent_lease_wait_s": 1800, "eval_timeout_s": 600},
]


@pytest.mark.parametrize("given", SETTINGS)
def test_the_plugins_default_deadline_exceeds_the_agents_bound_for_the_same_settings(given):
    settings = PluginSettings(**given)
    agent = budget.client_deadline(
        wall_timeout_s=settings.wall_timeout_s,
        eval_timeout_s=settings.eval_timeout_s,
        harness=settings.harness,
        config_name=settings.config_name,
        lease_wait_s=settings.agent_lease_wait_s,
    )
    assert settings.episode_deadline_s > agent.bound_s
    assert settings.episode_deadline_s == agent.deadline_s
    # `swerl eval` asks the same function, so with the agent's default wait it sets the same.
    if "agent_lease_wait_s" not in given:
        limits = {k: v for k, v in given.items() if k != "max_turns"}
        assert EvalConfig(policy_endpoint="http://p", **limits).episode_deadline_s == (
            settings.episode_deadline_s
        )


def test_the_bound_counts_the_lease_wait_the_limits_and_the_grading_overhead():
    defaults = load_config().defaults
    # The run script's limits: the agent's 3600 s loop, a 600 s grading.
    assert defaults.wall_timeout_s == 3600
    deadline = budget.client_deadline(eval_timeout_s=600)
    assert deadline.bound_s == 600 + 3600 + 600 + 60 == 4860
    assert deadline.deadline_s == 4920
    assert PluginSettings(eval_timeout_s=600).episode_deadline_s == 4920
    # Unset limits are the agent config's defaults, as the agent resolves them.
    unset = budget.client_deadline()
    assert unset.bound_s == 600 + defaults.wall_timeout_s + defaults.eval_timeout_s + 60
    # A harness episode's one budget covers its grading: no eval_timeout of its own.
    harnessed = budget.client_deadline(wall_timeout_s=1200, eval_timeout_s=300, harness="x")
    assert harnessed.bound_s == 600 + 1200 + 60
    assert budget.client_deadline(lease_wait_s=1800, eval_timeout_s=600).bound_s == 6060


def test_a_configured_deadline_not_above_the_agents_bound_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as refused:
        PluginSettings(eval_timeout_s=600, episode_deadline_s=3600)
    message = str(refused.value)
    assert (
        "episode_deadline_s (3600 s) must exceed the agent's bound on the episode (4860 s = "
        "600 s lease wait + 3600 s wall_timeout + 600 s eval_timeout + 60 s grading overhead);"
        " leave it unset for 4920 s (that bound + 60 s)"
    ) in message
    # The bound itself is not enough; a second past it is.
    with pytest.raises(ValueError, match=r"\(4860 s\) must exceed"):
        PluginSettings(eval_timeout_s=600, episode_deadline_s=4860)
    assert PluginSettings(eval_timeout_s=600, episode_deadline_s=4861).episode_deadline_s == 4861


def test_a_harness_deadline_is_refused_with_the_harness_budgets_parts():
    with pytest.raises(ValueError) as refused:
        PluginSettings(harness="mini-swe-agent", wall_timeout_s=1800, episode_deadline_s=2400)
    assert (
        "episode_deadline_s (2400 s) must exceed the agent's bound on the episode (2460 s = "
        "600 s lease wait + 1800 s wall_timeout (the harness's budget) + 60 s grading overhead)"
    ) in str(refused.value)
    accepted = PluginSettings(
        harness="mini-swe-agent", wall_timeout_s=1800, episode_deadline_s=2500
    )
    assert accepted.episode_deadline_s == 2500


def test_a_deadline_from_the_env_or_slimes_config_is_refused_the_same_way(monkeypatch):
    monkeypatch.setenv("SWERL_PLUGIN_EVAL_TIMEOUT_S", "600")
    monkeypatch.setenv("SWERL_PLUGIN_EPISODE_DEADLINE_S", "3600")
    with pytest.raises(ValueError, match=r"episode_deadline_s \(3600 s\) .* \(4860 s = "):
        PluginSettings()
    monkeypatch.delenv("SWERL_PLUGIN_EPISODE_DEADLINE_S")
    args = make_args(["127.0.0.1:1"], episode_deadline_s=4000.0)
    with pytest.raises(ValueError, match=r"episode_deadline_s \(4000 s\) .* \(4860 s = "):
        settings_from_args(args)
    # An agent that waits longer for its sandboxes raises the bound with it.
    longer = make_args(["127.0.0.1:1"], agent_lease_wait_s=1200.0, episode_deadline_s=5000.0)
    with pytest.raises(ValueError, match=r"\(5460 s = 1200 s lease wait \+ "):
        settings_from_args(longer)
    monkeypatch.delenv("SWERL_PLUGIN_EVAL_TIMEOUT_S")
    assert PluginSettings().eval_timeout_s == 0.0  # an unset limit is the agent's to judge


def test_the_run_scripts_plugin_config_keeps_the_deadline_past_the_agents_bound():
    script = (ROOT / "deploy/slime/run-qwen3-8b-grpo.sh").read_text()
    block = script.split('cat >"${PLUGIN_CONFIG}" <<YAML\n', 1)[1].split("\nYAML\n", 1)[0]
    numeric = {
        key: float(value)
        for key, value in re.findall(r"^swerl_(\w+): ([0-9.]+)$", block, flags=re.MULTILINE)
    }
    assert numeric["eval_timeout_s"] == 600
    settings = PluginSettings(**numeric)
    assert settings.episode_deadline_s == 4920
