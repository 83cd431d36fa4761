"""Bad rows fed to every command that reads task rows: `swerl tasks build`, `swerl validate`,
`swerl eval` (a tasks directory, JSON lines, parquet) and `swerl data prepare` (JSON lines,
parquet). Each ends with a non-zero status and one line on stderr that names the row (its file,
or its source and row number) and the field, never a traceback.

Every case fails while reading the input, before an image is built or a service started.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from swerl.cli import main
from swerl.tasks import load_tasks

BUNDLED = Path(__file__).resolve().parents[2] / "examples" / "tasks"
TASK = "swerl-examples__listutils-14"
SOURCE = {t.instance_id: t for t in load_tasks(BUNDLED)}[TASK]


@pytest.fixture(autouse=True)
def _own_environment(monkeypatch):
    # main() sets quiet defaults in os.environ; keep them to this test.
    for name in ("GRPC_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _no_instance_id(row: dict[str, Any]) -> None:
    del row["instance_id"]


def _fail_to_pass_not_json(row: dict[str, Any]) -> None:
    row["FAIL_TO_PASS"] = "test_core.py::test_a, test_core.py::test_b"


def _fail_to_pass_not_a_list(row: dict[str, Any]) -> None:
    row["FAIL_TO_PASS"] = {"tests": "tests/test_core.py::test_chunked_keeps_short_last_chunk"}


def _unknown_image(row: dict[str, Any]) -> None:
    row["image_name"] = "Not An Image!"


# bad row -> (field the one line must name, what the line must say about it)
BAD_ROWS: dict[str, tuple[Callable[[dict[str, Any]], None], str, str]] = {
    "no_instance_id": (_no_instance_id, "instance_id", "missing"),
    "fail_to_pass_not_json": (_fail_to_pass_not_json, "FAIL_TO_PASS", "JSON"),
    "fail_to_pass_not_a_list": (_fail_to_pass_not_a_list, "FAIL_TO_PASS", "list"),
    "unknown_image": (_unknown_image, "image_name", "not a Docker image reference"),
}


def _one_line_without_traceback(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code != 0, captured
    assert "Traceback" not in captured.err + captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def _task_dir(tmp_path: Path, edit: Callable[[dict[str, Any]], None] | None) -> Path:
    root = tmp_path / "tasks"
    shutil.copytree(SOURCE.directory, root / TASK)
    instance_file = root / TASK / "instance.json"
    if edit is None:
        instance_file.write_text('{"instance_id": "swerl-examples__listutils-14", oops')
    else:
        row = json.loads(instance_file.read_text())
        edit(row)
        instance_file.write_text(json.dumps(row))
    return root


def _rows_file(tmp_path: Path, edit: Callable[[dict[str, Any]], None], suffix: str) -> Path:
    # A raw row as SWE-bench publishes it: test lists as JSON text (unless the edit says not).
    row = {k: v for k, v in SOURCE.instance.items() if k != "eval_script"}
    row["FAIL_TO_PASS"] = json.dumps(row["FAIL_TO_PASS"])
    row["PASS_TO_PASS"] = json.dumps(row["PASS_TO_PASS"])
    edit(row)
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text(json.dumps(row) + "\n")
    else:
        if not isinstance(row.get("FAIL_TO_PASS"), str):
            row["FAIL_TO_PASS"] = json.dumps(row["FAIL_TO_PASS"])  # parquet wants one type
        pq.write_table(pa.Table.from_pylist([row]), path)
    return path


def _tasks_commands(root: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "tasks build": ["tasks", "build", "--tasks", str(root)],
        "validate": ["validate", "--no-build", "--tasks", str(root)],
        "eval": ["eval", str(root), "--replay", "gold", "--no-build", "-o", str(tmp_path / "o")],
    }


@pytest.mark.parametrize("command", ["tasks build", "validate", "eval"])
@pytest.mark.parametrize("bad", sorted(BAD_ROWS))
def test_a_bad_row_in_a_tasks_directory_is_one_line_naming_file_and_field(
    tmp_path, capsys, command, bad
):
    edit, field, says = BAD_ROWS[bad]
    root = _task_dir(tmp_path, edit)
    code = main(_tasks_commands(root, tmp_path)[command])
    line = _one_line_without_traceback(capsys, code)
    assert str(root / TASK / "instance.json") in line
    assert field in line and says in line


@pytest.mark.parametrize("command", ["tasks build", "validate", "eval"])
def test_an_instance_file_that_is_not_json_is_one_line(tmp_path, capsys, command):
    root = _task_dir(tmp_path, None)
    code = main(_tasks_commands(root, tmp_path)[command])
    line = _one_line_without_traceback(capsys, code)
    assert str(root / TASK / "instance.json") in line and "not valid JSON" in line


@pytest.mark.parametrize("command", ["tasks build", "validate", "eval"])
def test_a_missing_tasks_directory_is_one_line(tmp_path, capsys, command):
    missing = tmp_path / "nowhere"
    code = main(_tasks_commands(missing, tmp_path)[command])
    line = _one_line_without_traceback(capsys, code)
    assert str(missing) in line


def _rows_commands(path: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "eval": [
            "eval",
            str(path),
            "--policy-url",
            "http://127.0.0.1:9",
            "-o",
            str(tmp_path / "o"),
        ],
        "data prepare": ["data", "prepare", str(path), "--out", str(tmp_path / "prepared")],
        "validate": ["validate", str(path)],
        "tasks build": ["tasks", "build", str(path)],
    }


ROWS_COMMANDS = ["eval", "data prepare", "validate", "tasks build"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("command", ROWS_COMMANDS)
@pytest.mark.parametrize("bad", sorted(BAD_ROWS))
def test_a_bad_raw_row_is_one_line_naming_source_row_and_field(
    tmp_path, capsys, command, suffix, bad
):
    edit, field, _says = BAD_ROWS[bad]
    path = _rows_file(tmp_path, edit, suffix)
    code = main(_rows_commands(path, tmp_path)[command])
    line = _one_line_without_traceback(capsys, code)
    assert f"{path}: row 0: " in line and field in line


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("command", ROWS_COMMANDS)
def test_a_file_that_is_not_rows_at_all_is_one_line(tmp_path, capsys, command, suffix):
    path = tmp_path / f"rows{suffix}"
    path.write_text('{"instance_id": "a__b-1", oops\n')
    code = main(_rows_commands(path, tmp_path)[command])
    line = _one_line_without_traceback(capsys, code)
    assert str(path) in line


@pytest.mark.parametrize("command", ROWS_COMMANDS)
def test_a_missing_rows_file_is_one_line(tmp_path, capsys, command):
    missing = tmp_path / "nowhere" / "rows.jsonl"
    code = main(_rows_commands(missing, tmp_path)[command])
    line = _one_line_without_traceback(capsys, code)
    assert str(missing) in line and "no such file or directory" in line
