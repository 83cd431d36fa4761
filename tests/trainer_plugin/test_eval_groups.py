"""Evaluation on complete prompt groups (issue 23 item 3): with `--log-passrate` both frameworks
reshape an eval dataset's rewards into groups of n and assert `len == groups x n` (slime
`observability/rollout_metrics.py:238-245` -> `metric_utils.py:27`; miles
`ray/rollout/metrics.py:44-50` -> `utils/metric_utils.py:24`), so the eval hook leaves out whole
groups, never single episodes; n and `index` are per eval dataset (slime `utils/eval_config.py`,
`rollout/sglang_rollout.py:570-576`).

Runs against the stand-in SWERL_TEST_FRAMEWORK names (conftest.py); CI runs both.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from testkit.plugin import make_args, make_sample

from swerl.trainer_plugin import branching

pytestmark = pytest.mark.usefixtures("fw")


def eval_samples(rewards: list[float], failed: dict[int, str]) -> list[Any]:
    """One eval dataset's samples as the framework hands them to the logger: index 0.. in
    prompt order; `failed` maps an index to "infra" or "cancelled"."""
    out = []
    for index, reward in enumerate(rewards):
        sample = make_sample(index=index)
        sample.reward = reward
        if failed.get(index) == "infra":
            sample.metadata.update(infra_error=True, episode_status="INFRA_ERROR")
        elif failed.get(index) == "cancelled":
            sample.metadata.update(episode_status="CANCELLED")
        out.append(sample)
    return out


def entry(samples: list[Any]) -> dict[str, Any]:
    return {
        "rewards": [s.reward for s in samples],
        "truncated": [False for _ in samples],
        "samples": samples,
    }


def test_eval_with_log_passrate_survives_an_infra_failure_and_drops_its_whole_group(fw):
    # 3 prompts x 4; prompt 1's second episode (index 5) failed on infrastructure.
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    samples = eval_samples(rewards, {5: "infra"})
    args = make_args(["x:1"])
    args.n_samples_per_eval_prompt = 4
    args.log_passrate = True
    args.eval_datasets = [argparse.Namespace(name="swe-val", n_samples_per_eval_prompt=None)]
    logged = fw.log_eval(args, 0, {"swe-val": entry(samples)}, {})
    # The framework's own arithmetic ran on groups 0 and 2 only (index 4..7 left out whole).
    kept = rewards[0:4] + rewards[8:12]
    assert logged["eval/swe-val"] == pytest.approx(sum(kept) / len(kept))
    assert logged["eval/swe-val-pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert logged["eval/swe-val-pass@4"] == pytest.approx(1.0)
    # The ungraded episode and the graded ones left out with it are reported apart.
    assert logged["eval/swe-val-infra_errors"] == 1.0
    assert logged["eval/swe-val-cancelled"] == 0.0
    assert logged["eval/swe-val-incomplete_groups"] == 1.0
    assert logged["eval/swe-val-graded_left_out"] == 3.0


def test_eval_groups_are_per_dataset_size_and_index(fw):
    # Dataset "a" has its own n = 2, "b" the run's n = 4; each numbers its samples from 0.
    args = make_args(["x:1"])
    args.n_samples_per_eval_prompt = 4
    args.eval_datasets = [
        argparse.Namespace(name="a", n_samples_per_eval_prompt=2),
        argparse.Namespace(name="b", n_samples_per_eval_prompt=None),
    ]
    a = eval_samples([1.0, 1.0, 0.0, 0.0, 1.0, 0.0], {3: "cancelled"})
    b = eval_samples([0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], {})
    data = {"a": entry(a), "b": entry(b)}
    logged = fw.log_eval(args, 0, data, {})
    assert [s.index for s in data["a"]["samples"]] == [0, 1, 4, 5]
    assert data["a"]["rewards"] == [1.0, 1.0, 1.0, 0.0]
    assert logged["eval/a"] == pytest.approx(0.75)
    assert logged["eval/a-cancelled"] == 1.0 and logged["eval/a-incomplete_groups"] == 1.0
    assert logged["eval/a-graded_left_out"] == 1.0
    assert len(data["b"]["samples"]) == 8 and logged["eval/b-incomplete_groups"] == 0.0
    assert logged["eval/b"] == pytest.approx(3 / 8)


def test_an_eval_dataset_with_no_complete_group_is_reported_by_its_counts_only(fw):
    args = make_args(["x:1"])
    args.n_samples_per_eval_prompt = 2
    args.log_passrate = True
    samples = eval_samples([1.0, 0.0, 1.0, 1.0], {0: "infra", 3: "cancelled"})
    data = {"only": entry(samples)}
    logged = fw.log_eval(args, 0, data, {})
    assert "eval/only" not in logged and "only" not in data
    assert logged["eval/only-infra_errors"] == 1.0 and logged["eval/only-cancelled"] == 1.0
    assert logged["eval/only-incomplete_groups"] == 2.0


def test_an_eval_branching_group_takes_its_datasets_own_size():
    args = make_args(["x:1"])
    args.n_samples_per_eval_prompt = 4
    args.eval_datasets = [
        argparse.Namespace(name="small", n_samples_per_eval_prompt=2),
        argparse.Namespace(name="plain", n_samples_per_eval_prompt=None),
    ]
    assert branching.group_size(args, evaluation=True, dataset="small") == 2
    assert branching.group_size(args, evaluation=True, dataset="plain") == 4
    assert branching.group_size(args, evaluation=False) == args.n_samples_per_prompt
