"""`swerl validate` on real dockerd: a sound task set passes, a broken one fails the command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from swerl.cli import main
from swerl.tasks import default_tasks_dir

TASK = "swerl-examples__semverlite-41"


def _copy_task(tmp_path: Path) -> Path:
    root = tmp_path / "tasks"
    shutil.copytree(default_tasks_dir() / TASK, root / TASK)
    return root


def test_validate_passes_a_sound_task_and_prints_the_table(tmp_path, base_image, capsys):
    root = _copy_task(tmp_path)
    assert main(["validate", "--tasks", str(root), "--base-image", base_image]) == 0
    out = capsys.readouterr().out
    assert "unpatched tree as the task says 1/1" in out
    assert "gold resolved 1/1" in out
    assert "correctly not resolved 2/2" in out
    assert "broken task" not in out
    assert "test_prerelease_sorts_before_release" in out


def test_validate_fails_when_a_gold_patch_does_not_resolve(tmp_path, base_image, capsys):
    root = _copy_task(tmp_path)
    instance_file = root / TASK / "instance.json"
    instance = json.loads(instance_file.read_text())
    # A FAIL_TO_PASS test that no patch can make pass: the task itself is broken.
    instance["FAIL_TO_PASS"].append("tests/test_compare.py::test_that_does_not_exist")
    instance_file.write_text(json.dumps(instance, indent=2))
    assert main(["validate", "--tasks", str(root), "--base-image", base_image]) == 1
    out = capsys.readouterr().out
    assert "gold resolved 0/1" in out
    assert "test_that_does_not_exist" in out


def test_validate_reports_a_task_broken_when_a_fail_to_pass_test_already_passes(
    tmp_path, base_image, capsys
):
    root = _copy_task(tmp_path)
    instance_file = root / TASK / "instance.json"
    instance = json.loads(instance_file.read_text())
    # A PASS_TO_PASS test passes on the unpatched tree, so it cannot be a FAIL_TO_PASS test.
    already_passing = instance["PASS_TO_PASS"][0]
    instance["FAIL_TO_PASS"] = [already_passing]
    instance["PASS_TO_PASS"] = instance["PASS_TO_PASS"][1:]
    instance_file.write_text(json.dumps(instance, indent=2))
    assert main(["validate", "--tasks", str(root), "--base-image", base_image]) == 1
    out = capsys.readouterr().out
    assert "unpatched tree as the task says 0/1" in out
    assert f"broken task {TASK}: FAIL_TO_PASS passing unpatched: {already_passing}" in out


def test_validate_refuses_a_malformed_row_in_one_line_without_a_traceback(tmp_path, capsys):
    root = _copy_task(tmp_path)
    instance_file = root / TASK / "instance.json"
    instance = json.loads(instance_file.read_text())
    instance["FAIL_TO_PASS"] = "not a json list"
    instance_file.write_text(json.dumps(instance))
    for command in (["validate", "--no-build"], ["tasks", "build"]):
        assert main([*command, "--tasks", str(root)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("swerl: ") and "Traceback" not in err
        assert "FAIL_TO_PASS" in err and str(instance_file) in err
        assert err.count("\n") == 1


def test_an_unpatched_run_without_test_results_does_not_pass_the_unpatched_check():
    from swerl.exec.v1 import evaluate_pb2 as pb
    from swerl.tasks import load_tasks
    from swerl.validate import _judge

    (task,) = [t for t in load_tasks(default_tasks_dir()) if t.instance_id == TASK]
    report = pb.EvaluationReport(
        status=pb.EVALUATION_STATUS_UNRESOLVED, error_reason="NO_TEST_RESULTS"
    )
    ok, detail = _judge(task, "unpatched", report)
    assert not ok and detail == "NO_TEST_RESULTS"
