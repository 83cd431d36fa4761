"""One SWE-bench column list: a dataset row survives the trip to SweInstance and back."""

from __future__ import annotations

import json

import pytest

from swerl.exec.evaluate_servicer import instance_from_pb as servicer_from_pb
from swerl.exec.sweinstance import (
    KNOWN_COLUMNS,
    LIST_COLUMNS,
    TEXT_COLUMNS,
    InstanceError,
    instance_from_pb,
    instance_to_pb,
)
from swerl.exec.v1 import evaluate_pb2 as pb
from swerl.trainer_plugin import hooks as plugin_hooks
from swerl.validate import instance_to_pb as validate_to_pb

ROW = {
    "instance_id": "owner__repo-1",
    "repo": "owner/repo",
    "version": "0.20",
    "base_commit": "a" * 40,
    "test_patch": "diff --git a/t b/t\n",
    "FAIL_TO_PASS": '["tests/test_a.py::test_x"]',
    "PASS_TO_PASS": ["tests/test_a.py::test_y"],
    "problem_statement": "it breaks",
    "patch": "diff --git a/x b/x\n",
    "difficulty": "<15 min fix",
    "wrong_patch_breaks": ["tests/test_a.py::test_y"],
}


def test_every_text_and_list_column_is_a_field_of_the_contract():
    fields = set(pb.SweInstance.DESCRIPTOR.fields_by_name)
    assert set(TEXT_COLUMNS) <= fields
    assert set(LIST_COLUMNS.values()) <= fields
    assert set(fields) - {"extra"} == set(TEXT_COLUMNS) | set(LIST_COLUMNS.values())


def test_a_row_comes_back_with_its_columns_and_decoded_test_lists():
    row = instance_from_pb(instance_to_pb(ROW))
    assert row["FAIL_TO_PASS"] == ["tests/test_a.py::test_x"]
    assert row["PASS_TO_PASS"] == ["tests/test_a.py::test_y"]
    assert row["version"] == "0.20"
    assert row["patch"] == ROW["patch"]
    assert row["difficulty"] == ROW["difficulty"]
    assert json.loads(row["wrong_patch_breaks"]) == ROW["wrong_patch_breaks"]
    assert set(KNOWN_COLUMNS) - set(LIST_COLUMNS.values()) <= set(row)


def test_validate_the_servicer_and_the_plugin_use_the_one_conversion():
    assert validate_to_pb is instance_to_pb
    assert servicer_from_pb is instance_from_pb
    assert plugin_hooks.InstanceError is InstanceError
    assert plugin_hooks.sample_instance(ROW).fail_to_pass == ["tests/test_a.py::test_x"]


def test_a_test_list_that_is_not_a_list_is_refused_naming_the_column():
    with pytest.raises(InstanceError, match="PASS_TO_PASS"):
        instance_to_pb({**ROW, "PASS_TO_PASS": "not json"})
