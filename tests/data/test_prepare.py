"""`swerl data prepare` on local parquet / jsonl / arrow files built here (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from swerl.cli import main
from swerl.data.naming import derived_image_name, image_name
from swerl.data.prepare import DataSourceError, load_rows, prepare

# SWE-bench stores the test lists as JSON text; SWE-Gym as real lists.
SWE_BENCH_ROWS = [
    {
        "instance_id": "astropy__astropy-12907",
        "repo": "astropy/astropy",
        "version": "4.3",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "problem_statement": "separability_matrix is wrong for nested models",
        "patch": "diff --git a/a b/a\n",
        "test_patch": "diff --git a/t b/t\n",
        "FAIL_TO_PASS": json.dumps(["test_a", "test_b"]),
        "PASS_TO_PASS": json.dumps(["test_c"]),
        "hints_text": "",
        "created_at": "2022-03-03T15:14:54Z",
        "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
    },
    {
        "instance_id": "django__django-11099",
        "repo": "django/django",
        "version": "3.0",
        "base_commit": "d26b2424437dabeeca94d7900b37d2df4410da0c",
        "problem_statement": "UsernameValidator allows trailing newline",
        "patch": "diff --git a/a b/a\n",
        "test_patch": "diff --git a/t b/t\n",
        "FAIL_TO_PASS": json.dumps(["test_ascii_validator (auth_tests.test_validators.Tests)"]),
        "PASS_TO_PASS": "[]",
        "hints_text": "",
        "created_at": "2019-03-20T03:46:18Z",
        "environment_setup_commit": "419a78300f7cd27611196e1e464d50fd0385ff27",
    },
]
SWE_GYM_ROWS = [
    {
        "instance_id": "getmoto__moto-5752",
        "repo": "getmoto/moto",
        "version": "4.0",
        "base_commit": "b2300f1eae1323e3e8bc45f97e530ce129dff12e",
        "problem_statement": "describe_parameters depends on filter order",
        "patch": "diff --git a/a b/a\n",
        "test_patch": "diff --git a/t b/t\n",
        "FAIL_TO_PASS": ["tests/test_ssm.py::test_describe_parameters__multiple_tags"],
        "PASS_TO_PASS": ["tests/test_ssm.py::test_put_parameter"],
        "hints_text": "",
        "created_at": "2022-12-10T20:23:01Z",
    },
    {
        "instance_id": "Project-MONAI__MONAI-2238",
        "repo": "Project-MONAI/MONAI",
        "version": "0.5",
        "base_commit": "fac93503994d21c877cba6844135f1bd9168c061",
        "problem_statement": "Transform does not honour the given dtype",
        "patch": "diff --git a/a b/a\n",
        "test_patch": "diff --git a/t b/t\n",
        "FAIL_TO_PASS": ["tests/test_x.py::test_dtype"],
        "PASS_TO_PASS": [],
        "hints_text": "",
        "created_at": "2021-05-25T08:00:00Z",
    },
]


def _bad_rows() -> list[dict]:
    good = dict(SWE_BENCH_ROWS[0])

    def variant(**changes):
        row = dict(good, instance_id=f"bad__row-{len(rows)}")
        row.update(changes)
        return row

    rows: list[dict] = []
    rows.append(variant(FAIL_TO_PASS="[]"))
    rows.append(variant(test_patch=""))
    rows.append(variant(problem_statement="   "))
    rows.append(variant(FAIL_TO_PASS="not json"))
    rows.append(variant(repo="", version=""))
    rows.append(variant(instance_id=""))
    rows.append(dict(good))  # duplicate of SWE_BENCH_ROWS[0]
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_swe_bench_parquet_becomes_slime_jsonl_with_swe_bench_image_names(tmp_path):
    source = _write_parquet(tmp_path / "swe-bench-verified.parquet", SWE_BENCH_ROWS)
    report = prepare([str(source)], tmp_path / "out", cache_dir=tmp_path / "cache")

    assert (report.rows, report.kept, sum(report.skipped.values())) == (2, 2, 0)
    lines = _lines(tmp_path / "out" / "data.jsonl")
    assert [line["text"] for line in lines] == [r["problem_statement"] for r in SWE_BENCH_ROWS]
    first = lines[0]["metadata"]
    assert first["data_source"] == "swe-bench-verified"
    instance = first["instance"]
    assert instance["image_name"] == (
        "docker.io/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    )
    assert instance["FAIL_TO_PASS"] == ["test_a", "test_b"]
    assert instance["PASS_TO_PASS"] == ["test_c"]
    # Every column survives, untouched.
    assert instance["environment_setup_commit"] == SWE_BENCH_ROWS[0]["environment_setup_commit"]
    assert instance["patch"] == SWE_BENCH_ROWS[0]["patch"]
    assert (tmp_path / "out" / "instance_ids.txt").read_text().split() == [
        "astropy__astropy-12907",
        "django__django-11099",
    ]
    assert (tmp_path / "out" / "images.txt").read_text().split() == [
        "docker.io/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest",
        "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
    ]


def test_swe_gym_jsonl_gets_lower_cased_swe_gym_image_names(tmp_path):
    source = _write_jsonl(tmp_path / "SWE-Gym.jsonl", SWE_GYM_ROWS)
    report = prepare([str(source)], tmp_path / "out", cache_dir=tmp_path / "cache")

    assert report.kept == 2
    instances = [line["metadata"]["instance"] for line in _lines(tmp_path / "out" / "data.jsonl")]
    assert [i["image_name"] for i in instances] == [
        "docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-5752:latest",
        "docker.io/xingyaoww/sweb.eval.x86_64.project-monai_s_monai-2238:latest",
    ]
    assert instances[1]["PASS_TO_PASS"] == []


def test_explicit_image_name_wins_and_registry_prefix_replaces_the_namespace(tmp_path):
    rows = [dict(SWE_GYM_ROWS[0], image_name="registry.local/custom:v1"), SWE_GYM_ROWS[1]]
    source = _write_jsonl(tmp_path / "rows.jsonl", rows)
    prepare(
        [str(source)],
        tmp_path / "out",
        convention="swe-gym",
        registry_prefix="mirror.local:5000/gym/",
        cache_dir=tmp_path / "cache",
    )
    assert (tmp_path / "out" / "images.txt").read_text().split() == [
        "registry.local/custom:v1",
        "mirror.local:5000/gym/sweb.eval.x86_64.project-monai_s_monai-2238:latest",
    ]


def test_rows_evaluation_cannot_grade_are_skipped_counted_and_explained(tmp_path):
    source = _write_jsonl(tmp_path / "mixed.jsonl", [*SWE_BENCH_ROWS, *_bad_rows()])
    report = prepare([str(source)], tmp_path / "out", cache_dir=tmp_path / "cache")

    assert report.rows == 9
    assert report.kept == 2
    assert dict(report.skipped) == {
        "EMPTY_FAIL_TO_PASS": 1,
        "MISSING_TEST_PATCH": 1,
        "MISSING_PROBLEM_STATEMENT": 1,
        "BAD_TEST_LIST": 1,
        "MISSING_EVAL_SPEC": 1,
        "MISSING_INSTANCE_ID": 1,
        "DUPLICATE_INSTANCE_ID": 1,
    }
    skipped = _lines(tmp_path / "out" / "skipped.jsonl")
    assert [entry["row"] for entry in skipped] == [2, 3, 4, 5, 6, 7, 8]
    assert all(entry["detail"] for entry in skipped)
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written["skipped"] == 7 and written["kept"] == 2
    assert len(_lines(tmp_path / "out" / "data.jsonl")) == 2


def test_an_exit_code_task_with_its_own_script_needs_no_test_lists(tmp_path):
    row = dict(
        SWE_BENCH_ROWS[0],
        instance_id="own__task-1",
        FAIL_TO_PASS=[],
        PASS_TO_PASS=[],
        eval_type="exit_code",
        eval_script="#!/bin/bash\npytest -q\n",
    )
    no_script = dict(row, instance_id="own__task-2", eval_script="")
    source = _write_jsonl(tmp_path / "own.jsonl", [row, no_script])
    report = prepare([str(source)], tmp_path / "out", cache_dir=tmp_path / "cache")
    assert report.kept == 1
    assert dict(report.skipped) == {"MISSING_EVAL_SCRIPT": 1}


def test_several_sources_and_arrow_files_are_merged_with_their_own_data_source(tmp_path):
    bench = _write_parquet(tmp_path / "bench.parquet", SWE_BENCH_ROWS)
    saved = tmp_path / "swe-gym-saved"
    datasets.Dataset.from_list(SWE_GYM_ROWS).save_to_disk(str(saved))
    arrow = next(saved.glob("*.arrow"))

    report = prepare([str(bench), str(arrow)], tmp_path / "out", cache_dir=tmp_path / "cache")
    assert report.kept == 4
    lines = _lines(tmp_path / "out" / "data.jsonl")
    assert [line["metadata"]["data_source"] for line in lines][:2] == ["bench", "bench"]
    # A save_to_disk directory loads as well, and its name selects the SWE-Gym rule.
    report = prepare([str(saved)], tmp_path / "out2")
    names = (tmp_path / "out2" / "images.txt").read_text().split()
    assert report.kept == 2 and all("xingyaoww" in name for name in names)


def test_cli_prepares_files_and_exits_2_on_a_missing_source(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "swe-gym-lite.jsonl", SWE_GYM_ROWS)
    out = tmp_path / "out"
    code = main(["data", "prepare", str(source), "--out", str(out), "--cache-dir", str(tmp_path)])
    assert code == 0
    assert "kept 2 of 2 rows" in capsys.readouterr().out
    assert len((out / "data.jsonl").read_text().splitlines()) == 2

    code = main(["data", "prepare", str(tmp_path / "absent.parquet"), "--out", str(out)])
    assert code == 2
    assert "no such file" in capsys.readouterr().err


def test_a_file_with_no_usable_rows_exits_1(tmp_path):
    source = _write_jsonl(tmp_path / "bad.jsonl", _bad_rows()[:2])
    assert main(["data", "prepare", str(source), "--out", str(tmp_path / "out")]) == 1


def test_unknown_file_types_are_refused_with_the_supported_ones_named(tmp_path):
    source = tmp_path / "rows.txt"
    source.write_text("x")
    with pytest.raises(DataSourceError, match=r"\.parquet"):
        list(load_rows(str(source)))


def test_a_hub_dataset_that_is_not_cached_fails_cleanly_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    with pytest.raises(DataSourceError, match="swerl-no-such/dataset"):
        list(load_rows("swerl-no-such/dataset", cache_dir=tmp_path))


def test_naming_rules_match_the_published_image_names():
    assert derived_image_name("sympy__sympy-20590", "swe-bench") == (
        "docker.io/swebench/sweb.eval.x86_64.sympy_1776_sympy-20590:latest"
    )
    assert derived_image_name("pandas-dev__pandas-53419", "swe-gym") == (
        "docker.io/xingyaoww/sweb.eval.x86_64.pandas-dev_s_pandas-53419:latest"
    )
    row = {"instance_id": "a__b-1", "image_name": "  "}
    assert image_name(row, convention="auto", data_source="SWE-Gym/SWE-Gym").startswith(
        "docker.io/xingyaoww/"
    )
