"""`swerl eval`'s dataset reading, selection and result bookkeeping, without services."""

from __future__ import annotations

import json

import pytest

from swerl.agent.config import load_config
from swerl.evaluation.dataset import load_instances, parse_slice, select
from swerl.evaluation.results import OutputDir, summarize
from swerl.evaluation.runner import EvalConfig, Progress, episode_start
from swerl.tasks import default_tasks_dir

ROW = {
    "instance_id": "django__django-11099",
    "repo": "django/django",
    "version": "3.0",
    "base_commit": "d26b2424437dabeeca94d7900b37d2df4410da0c",
    "problem_statement": "UsernameValidator allows trailing newline",
    "test_patch": "diff --git a/t b/t\n",
    "FAIL_TO_PASS": json.dumps(["test_ascii_validator (auth_tests.test_validators.Tests)"]),
    "PASS_TO_PASS": "[]",
    "custom_column": {"nested": 1},
}


def test_a_tasks_directory_prepared_jsonl_and_raw_rows_all_load(tmp_path):
    tasks = load_instances(default_tasks_dir())
    assert len(tasks.instances) == 6
    assert all(i.instance["image_name"].startswith("swerl-examples/") for i in tasks.instances)

    prepared = tmp_path / "data.jsonl"
    line = {"text": "x", "metadata": {"instance": ROW, "data_source": "SWE-Gym/SWE-Gym"}}
    prepared.write_text(json.dumps(line) + "\n")
    (loaded,) = load_instances(prepared).instances
    assert loaded.data_source == "SWE-Gym/SWE-Gym"
    assert loaded.instance["image_name"].startswith("docker.io/xingyaoww/")
    assert loaded.instance["FAIL_TO_PASS"] == [
        "test_ascii_validator (auth_tests.test_validators.Tests)"
    ]

    raw = tmp_path / "swe-bench.jsonl"
    bad = dict(ROW, instance_id="x__y-1", FAIL_TO_PASS="[]")
    raw.write_text("".join(json.dumps(r) + "\n" for r in (ROW, bad, ROW)))
    result = load_instances(raw, registry_prefix="mirror:5000/sb")
    assert [i.instance_id for i in result.instances] == ["django__django-11099"]
    assert result.instances[0].instance["image_name"] == (
        "mirror:5000/sb/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    assert dict(result.skipped) == {"EMPTY_FAIL_TO_PASS": 1, "DUPLICATE_INSTANCE_ID": 1}


def test_selection_filters_shuffles_with_a_seed_and_slices():
    instances = load_instances(default_tasks_dir()).instances
    ids = [i.instance_id for i in instances]
    assert [i.instance_id for i in select(instances, slice_spec="1:3")] == ids[1:3]
    assert [i.instance_id for i in select(instances, pattern="roman|text")] == [
        "swerl-examples__romans-5",
        "swerl-examples__textkit-9",
    ]
    named = select(instances, instance_ids=["swerl-examples__romans-5", "unknown"])
    assert [i.instance_id for i in named] == ["swerl-examples__romans-5"]
    one = [i.instance_id for i in select(instances, shuffle=True, seed=3)]
    two = [i.instance_id for i in select(instances, shuffle=True, seed=3)]
    assert one == two and sorted(one) == ids
    assert parse_slice(":2") == slice(None, 2)
    with pytest.raises(ValueError, match="START:STOP"):
        parse_slice("1-2")


def test_episode_start_carries_the_instance_policy_limits_and_options():
    (instance,) = [
        i for i in load_instances(default_tasks_dir()).instances if "romans" in i.instance_id
    ]
    config = EvalConfig(
        policy_endpoint="http://p:1",
        policy_api="openai",
        model="m",
        sampling_params={"temperature": 0.5},
        max_turns=7,
        eval_timeout_s=90,
        artifact_dir="/tmp/a",
    )
    start = episode_start(instance, config, "ep-1")
    assert start.instance.instance_id == "swerl-examples__romans-5"
    assert list(start.instance.fail_to_pass) == instance.instance["FAIL_TO_PASS"]
    assert start.policy.api == 2 and start.policy.model == "m"
    assert start.policy.sampling_params["temperature"] == 0.5
    assert start.limits.max_turns == 7 and start.limits.eval_timeout.seconds == 90
    assert start.options.artifact_dir == "/tmp/a"
    assert start.options.harness == ""  # the agent's default (builtin)
    named = episode_start(instance, EvalConfig(policy_endpoint="http://p", harness="x"), "e")
    assert named.options.harness == "x"


def _record(iid: str, status: str, resolved: bool = False, **extra) -> dict:
    return {
        "instance_id": iid,
        "status": status,
        "resolved": resolved,
        "eval_status": "RESOLVED_FULL" if resolved else ("" if status == "INFRA_ERROR" else "X"),
        "patch": "diff" if status != "INFRA_ERROR" else "",
        **extra,
    }


def test_the_last_record_of_an_instance_counts_and_a_torn_line_is_ignored(tmp_path):
    out = OutputDir(tmp_path)
    out.append(_record("a", "INFRA_ERROR"))
    out.append(_record("b", "SUBMITTED", True))
    with (tmp_path / "results.jsonl").open("a") as f:
        f.write('{"instance_id": "c", "sta')  # a crash mid-write
    assert out.finished(retry_errors=False) == {"a", "b"}
    assert out.finished(retry_errors=True) == {"b"}
    out = OutputDir(tmp_path)
    (tmp_path / "results.jsonl").write_text(
        (tmp_path / "results.jsonl").read_text().rsplit("\n", 1)[0] + "\n"
    )
    out.append(_record("a", "SUBMITTED", True))
    assert out.records()["a"]["resolved"] is True
    summary = out.write_derived(["a", "b", "c"], "model-x", {})
    assert (summary["instances"], summary["resolved"], summary["not_run"]) == (3, 2, 1)
    preds = [json.loads(x) for x in (tmp_path / "preds.jsonl").read_text().splitlines()]
    assert [p["instance_id"] for p in preds] == ["a", "b"]
    assert preds[0] == {"instance_id": "a", "model_name_or_path": "model-x", "model_patch": "diff"}


def test_summary_keeps_errors_apart_and_averages_metrics_where_reported():
    records = [
        _record("a", "SUBMITTED", True, metrics={"turns": 4.0, "eval_time": 2.0}),
        _record("b", "LIMIT_TURNS", metrics={"turns": 10.0}),
        _record("c", "INFRA_ERROR"),
        _record("d", "ABORTED"),
    ]
    summary = summarize(records, total=5)
    assert summary["resolved"] == 1 and summary["errors"] == 2
    assert summary["completed"] == 2 and summary["not_run"] == 1
    assert summary["resolve_rate"] == 0.2
    assert summary["graded"] == 3 and summary["resolve_rate_of_graded"] == pytest.approx(1 / 3)
    assert summary["metrics_mean"] == {"eval_time": 2.0, "turns": 7.0}
    assert summary["by_status"] == {
        "ABORTED": 1,
        "INFRA_ERROR": 1,
        "LIMIT_TURNS": 1,
        "SUBMITTED": 1,
    }


def test_progress_line_shows_done_resolved_errors_running_and_eta(capsys):
    progress = Progress(4)
    progress.running = 2
    assert "0/4 done | 0 resolved | 0 errors | 2 running | ETA --:--" in progress.line()
    progress.finish(_record("a", "SUBMITTED", True))
    progress.finish(_record("b", "INFRA_ERROR"))
    line = progress.line()
    assert "2/4 done | 1 resolved | 1 errors" in line and "ETA 00:0" in line
    assert capsys.readouterr().err.count("done") == 2


def _branches(iid: str, episode: str, outcomes: list[tuple[str, bool]]) -> list[dict]:
    return [
        _record(iid, status, resolved, episode_id=episode, branch=b, sampling_seed=100 + b)
        for b, (status, resolved) in enumerate(outcomes)
    ]


def test_branch_rows_combine_into_pass_at_n_and_a_pass_at_1_estimate(tmp_path):
    out = OutputDir(tmp_path)
    # a: 1 of 3 branches resolved; b: none (answered); c: none resolved, one infra error.
    out.append(
        *_branches("a", "e-a", [("SUBMITTED", False), ("SUBMITTED", True), ("LIMIT_TURNS", False)])
    )
    out.append(*_branches("b", "e-b", [("SUBMITTED", False)] * 3))
    out.append(
        *_branches("c", "e-c", [("SUBMITTED", False), ("INFRA_ERROR", False), ("SUBMITTED", False)])
    )
    records = out.records()
    assert records["a"]["resolved"] and records["a"]["branch"] == 1  # the resolved branch's row
    assert [r["sampling_seed"] for r in records["a"]["branches"]] == [100, 101, 102]
    assert not records["b"]["resolved"] and records["b"]["status"] == "SUBMITTED"
    assert records["c"]["status"] == "INFRA_ERROR"  # unknown answer: an error, retried
    assert out.finished(retry_errors=True) == {"a", "b"}
    summary = out.write_derived(["a", "b", "c", "d"], "m", {})
    assert summary["branches"] == 3
    assert summary["resolved"] == 1 and summary["errors"] == 1 and summary["not_run"] == 1
    assert summary["pass_at_n"] == pytest.approx(1 / 4)
    # pass@1: a 1/3, b 0/3, c 0/2 answered, d not run: over the 4 selected instances.
    assert summary["pass_at_1"] == pytest.approx((1 / 3) / 4)
    preds = [json.loads(x) for x in (tmp_path / "preds.jsonl").read_text().splitlines()]
    assert [p["instance_id"] for p in preds] == ["a", "b"]
    # A retried instance: its later episode's rows replace the earlier ones.
    out.append(
        *_branches("c", "e-c2", [("SUBMITTED", True), ("SUBMITTED", False), ("SUBMITTED", False)])
    )
    records = out.records()
    assert records["c"]["resolved"] and len(records["c"]["branches"]) == 3
    summary = out.write_derived(["a", "b", "c"], "m", {})
    assert summary["pass_at_n"] == pytest.approx(2 / 3)
    assert summary["pass_at_1"] == pytest.approx((1 / 3 + 0 + 1 / 3) / 3)


def test_a_summary_without_branches_has_no_best_of_n_figures():
    summary = summarize([_record("a", "SUBMITTED", True)], total=1)
    assert "pass_at_n" not in summary and "pass_at_1" not in summary


def test_a_branching_start_carries_the_fork_turn_and_the_branch_count():
    (instance,) = [
        i for i in load_instances(default_tasks_dir()).instances if i.instance_id.endswith("-5")
    ]
    config = EvalConfig(policy_endpoint="http://p", branch_at=2, branches=3)
    start = episode_start(instance, config, "e-1")
    assert (start.options.branch.at_turn, start.options.branch.count) == (2, 3)
    plain = episode_start(instance, EvalConfig(policy_endpoint="http://p"), "e-2")
    assert not plain.options.HasField("branch")


def test_the_episode_deadline_takes_unset_limits_from_the_agent_config():
    defaults = load_config().defaults
    # The agent's wait for the lease (600 s), its loop, its grading and the grading's overhead
    # (60 s), and a margin (60 s): past everything the agent may spend on the episode.
    expected = defaults.wall_timeout_s + defaults.eval_timeout_s + 720.0
    assert EvalConfig(policy_endpoint="http://p").episode_deadline_s == expected
    # A config this install does not ship: the default one's limits (the agent judges the name).
    assert EvalConfig(policy_endpoint="http://p", config_name="no-such").episode_deadline_s == (
        expected
    )
    config = EvalConfig(policy_endpoint="http://p", wall_timeout_s=10, eval_timeout_s=5)
    assert config.episode_deadline_s == 735.0
    # A harness episode's one budget covers its grading: the same wait, budget and margins.
    harnessed = EvalConfig(
        policy_endpoint="http://p", wall_timeout_s=10, eval_timeout_s=5, harness="mini-swe-agent"
    )
    assert harnessed.episode_deadline_s == 730.0
