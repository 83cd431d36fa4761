"""`swerl validate ROWS` and `swerl tasks build ROWS` on SWE-bench rows as published, end to end.

The rows file holds the official-layout fixture's classic row (testkit.official: no eval_script,
test lists as JSON text, no image_name), so its image is the one SWE-bench's naming rule gives,
which the test set-up built offline in the official layout. No Dockerfile is involved: a row's
image is used as published, never built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from testkit.evaluate import TASKS
from testkit.official import SOURCE_TASK, classic_row

from swerl.cli import main
from swerl.data.naming import derived_image_name
from swerl.tasks import load_task_source

pytestmark = pytest.mark.docker


def _row(**changes: Any) -> dict[str, Any]:
    row = classic_row(TASKS[SOURCE_TASK])
    row.update(changes)
    return row


def _jsonl(path: Path, *rows: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _one_line_without_traceback(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2, captured
    assert "Traceback" not in captured.err + captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_a_rows_file_names_the_image_by_swebenchs_rule_like_the_fixture(official_task, tmp_path):
    (task,) = load_task_source(_jsonl(tmp_path / "rows.jsonl", _row()))
    assert task.image_name == official_task.image_name
    assert task.dockerfile is None and task.directory is None
    assert task.fail_to_pass == official_task.fail_to_pass  # JSON text became a list
    assert task.where == f"{tmp_path / 'rows.jsonl'}: row 0 ({task.instance_id})"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_validate_runs_the_three_checks_on_a_published_row(official_task, tmp_path, capsys, suffix):
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        _jsonl(path, _row())
    else:
        pq.write_table(pa.Table.from_pylist([_row()]), path)
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"validating 1 tasks from {path}" in out
    for check in ("unpatched", "gold", "empty"):
        assert f"{official_task.instance_id}  {check}" in out
    assert "unpatched tree as the task says 1/1" in out
    assert "gold resolved 1/1" in out
    assert "correctly not resolved 1/1" in out


def test_validate_reports_a_published_row_broken_when_fail_to_pass_already_passes(
    official_task, tmp_path, capsys
):
    already_passing = official_task.pass_to_pass[0]
    row = _row(
        FAIL_TO_PASS=[already_passing],  # a real list this time: both shapes are read
        PASS_TO_PASS=json.dumps(official_task.pass_to_pass[1:]),
    )
    assert main(["validate", str(_jsonl(tmp_path / "rows.jsonl", row)), "--no-build"]) == 1
    out = capsys.readouterr().out
    assert "unpatched tree as the task says 0/1" in out
    assert (
        f"broken task {official_task.instance_id}: FAIL_TO_PASS passing unpatched: "
        f"{already_passing}" in out
    )


@pytest.mark.parametrize("build", [True, False])
def test_a_row_whose_image_is_not_on_the_node_is_one_line_naming_row_and_image(
    official_task, tmp_path, capsys, build
):
    # SWE-Gym's rule names another image, which nobody built or pulled here.
    path = _jsonl(tmp_path / "rows.jsonl", _row())
    gym_image = derived_image_name(official_task.instance_id, "swe-gym")
    argv = ["validate", str(path), "--image-convention", "swe-gym"]
    line = _one_line_without_traceback(capsys, main(argv + ([] if build else ["--no-build"])))
    assert f"{path}: row 0 ({official_task.instance_id})" in line
    assert f"image {gym_image} is not present" in line


def test_an_explicit_image_name_wins_over_the_naming_rule(official_task, tmp_path, capsys):
    row = _row(image_name=official_task.image_name)
    path = _jsonl(tmp_path / "rows.jsonl", row)
    assert main(["tasks", "build", str(path), "--image-convention", "swe-gym"]) == 0
    assert f"{official_task.image_name}: present" in capsys.readouterr().out


def test_tasks_build_checks_a_published_rows_image_and_its_base_commit(
    official_task, tmp_path, capsys
):
    path = _jsonl(tmp_path / "rows.jsonl", _row())
    assert main(["tasks", "build", str(path)]) == 0
    assert f"{official_task.image_name}: present" in capsys.readouterr().out
    wrong = _jsonl(tmp_path / "wrong.jsonl", _row(base_commit="1" * 40))
    line = _one_line_without_traceback(capsys, main(["tasks", "build", str(wrong)]))
    assert f"neither base_commit {'1' * 40} of {wrong}: row 0" in line
    assert "use the image published for this row" in line


def test_a_bad_row_is_one_line_for_validate_and_tasks_build(tmp_path, capsys):
    bad = _jsonl(tmp_path / "rows.jsonl", _row(), _row(instance_id="x__y-1", patch=""))
    for argv in (["validate", str(bad)], ["tasks", "build", str(bad)]):
        line = _one_line_without_traceback(capsys, main(argv))
        assert f"{bad}: row 1 (x__y-1): patch" in line


async def test_a_running_node_without_the_image_is_refused_before_any_evaluation(
    official_task, tmp_path
):
    # `swerl validate ROWS --node ADDR` asks the node's ListImages, not the local dockerd.
    from swerl.exec.server import local_node
    from swerl.tasks import TaskImageError
    from swerl.validate import require_node_images

    path = _jsonl(tmp_path / "rows.jsonl", _row())
    (present,) = load_task_source(path)
    (absent,) = load_task_source(path, convention="swe-gym")
    async with local_node("rows-test") as (_, channel):
        await require_node_images([present], channel)
        with pytest.raises(TaskImageError) as info:
            await require_node_images([present, absent], channel)
    assert f"{path}: row 0 ({absent.instance_id}): image {absent.image_name}" in str(info.value)
