"""The SWE-bench columns swerl knows, and a dataset row <-> `swerl.exec.v1.SweInstance`.

One list of columns for every place a row crosses the wire: the trainer plugin, `swerl eval` and
`swerl validate` turn rows into SweInstance messages, the exec node turns them back into the row
that the evaluator (and swebench) read. Known columns become typed fields; every other column
lands in `extra` (strings verbatim, anything else JSON-encoded) and comes back out as a column.
A slime sample's metadata (`sample_instance`) and a dataset's image naming rule
(`image_name_for`) live here too, since the plugin and the tools both need them.

It lives with the exec service because SweInstance is the exec contract's message; it is light
on purpose (the standard library and the generated contract only), so the trainer plugin can
import it without docker, swebench or transformers.
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


__all__ = [
    "KNOWN_COLUMNS",
    "LIST_COLUMNS",
    "TEXT_COLUMNS",
    "InstanceError",
    "as_test_list",
    "image_name_for",
    "instance_fields",
    "instance_from_pb",
    "instance_row",
    "instance_to_pb",
    "sample_instance",
]


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


# -- a slime sample's task --------------------------------------------------------------------
#
# slime copies each JSONL row's `--metadata-key` dict into `sample.metadata`. The predecessor's
# (and `swerl data prepare`'s) format is `{"instance": {...every dataset column...},
# "data_source": "..."}`; a metadata dict that is itself the row (has `instance_id`) works too.
# The image name follows the dataset's rule when the row has no explicit `image_name`.


def instance_row(metadata: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The dataset row inside `sample.metadata`."""
    if not isinstance(metadata, Mapping):
        raise InstanceError("sample.metadata is not a dict (set slime's --metadata-key)")
    row = metadata.get("instance")
    if isinstance(row, Mapping):
        return row
    if "instance_id" in metadata:
        return metadata
    raise InstanceError("sample.metadata has neither an 'instance' dict nor an 'instance_id'")


def image_name_for(instance_id: str, data_source: str = "") -> str:
    """The Docker image of an instance by its dataset's naming rule (lower-cased).

    SWE-Gym rows (a data source naming SWE-Gym) use xingyaoww's images with `__` as `_s_`;
    everything else uses SWE-bench's with `__` as `_1776_`.
    """
    if "gym" in data_source.lower():
        name = "docker.io/xingyaoww/sweb.eval.x86_64." + instance_id.replace("__", "_s_")
    else:
        name = "docker.io/swebench/sweb.eval.x86_64." + instance_id.replace("__", "_1776_")
    return name.lower() + ":latest"


def sample_instance(metadata: Mapping[str, Any] | None, prompt: Any = "") -> pb.SweInstance:
    """Converts the sample's metadata (and prompt, for a missing problem statement)."""
    row = instance_row(metadata)
    instance_id = str(row.get("instance_id") or "")
    if not instance_id:
        raise InstanceError("the instance has no instance_id")
    fields = instance_fields(row)
    if not fields.get("image_name"):
        data_source = ""
        if isinstance(metadata, Mapping):
            data_source = str(metadata.get("data_source") or row.get("data_source") or "")
        fields["image_name"] = image_name_for(instance_id, data_source)
    if not fields.get("problem_statement") and isinstance(prompt, str):
        fields["problem_statement"] = prompt
    return pb.SweInstance(**fields)
