"""The SWE-bench columns swerl knows, and a dataset row <-> `swerl.exec.v1.SweInstance`.

One list of columns for every place a row crosses the wire: the trainer plugin and `swerl
validate` turn rows into SweInstance messages, the exec node turns them back into the row that
the evaluator (and swebench) read. Known columns become typed fields; every other column lands
in `extra` (strings verbatim, anything else JSON-encoded) and comes back out as a column.

Light on purpose: the standard library and the generated contract only, so the trainer plugin
can import it without docker, swebench or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from swerl.exec.v1 import evaluate_pb2 as pb

# Text columns: the dataset's name is also the SweInstance field's name.
TEXT_COLUMNS: tuple[str, ...] = (
    "instance_id",
    "repo",
    "version",
    "base_commit",
    "test_patch",
    "eval_script",
    "log_parser",
    "eval_type",
    "image_name",
    "problem_statement",
    "hints_text",
    "environment_setup_commit",
    "created_at",
)
# Test-list columns: dataset name -> SweInstance field.
LIST_COLUMNS: Mapping[str, str] = {"FAIL_TO_PASS": "fail_to_pass", "PASS_TO_PASS": "pass_to_pass"}
KNOWN_COLUMNS = frozenset({*TEXT_COLUMNS, *LIST_COLUMNS, *LIST_COLUMNS.values()})


class InstanceError(ValueError):
    """The sample's metadata does not describe a task the agent can run."""


def as_test_list(value: Any, column: str) -> list[str]:
    """A test-list column as a list: SWE-bench ships JSON strings, prepared data real lists."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InstanceError(f"{column} is neither a list nor a JSON list: {exc}") from None
    if not isinstance(value, (list, tuple)):
        raise InstanceError(f"{column} is not a list")
    return [str(v) for v in value]


def instance_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    """The SweInstance fields of a row: known columns typed, the rest in `extra`.

    A test list may come under its column name or its field name; a missing text column stays
    unset. Raises InstanceError for a test list that is not a list.
    """
    fields: dict[str, Any] = {}
    for name in TEXT_COLUMNS:
        value = row.get(name)
        if value is not None:
            fields[name] = value if isinstance(value, str) else str(value)
    for column, name in LIST_COLUMNS.items():
        fields[name] = as_test_list(row.get(column, row.get(name)), column)
    fields["extra"] = {
        str(k): v if isinstance(v, str) else json.dumps(v, default=str)
        for k, v in row.items()
        if k not in KNOWN_COLUMNS
    }
    return fields


def instance_to_pb(row: Mapping[str, Any]) -> pb.SweInstance:
    """The row as a SweInstance (see instance_fields)."""
    return pb.SweInstance(**instance_fields(row))


def instance_from_pb(message: pb.SweInstance) -> dict[str, Any]:
    """The row back under SWE-bench's column names, as the evaluator and swebench read it."""
    row: dict[str, Any] = dict(message.extra)
    for name in TEXT_COLUMNS:
        row[name] = getattr(message, name)
    for column, name in LIST_COLUMNS.items():
        row[column] = list(getattr(message, name))
    return row
