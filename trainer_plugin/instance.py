"""The task of a slime sample as a `swerl.exec.v1.SweInstance`.

slime copies each JSONL row's `--metadata-key` dict into `sample.metadata`. The predecessor's
(and `swerl data prepare`'s) format is `{"instance": {...every dataset column...},
"data_source": "..."}`; a metadata dict that is itself the row (has `instance_id`) works too.
Columns swerl knows become typed fields, every other column lands in `extra` (strings verbatim,
anything else JSON-encoded). The image name follows the dataset's rule when the row has no
explicit `image_name`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from swerl.exec.v1 import evaluate_pb2
from swerl.sweinstance import InstanceError, instance_fields

__all__ = ["InstanceError", "image_name_for", "instance_row", "sample_instance"]


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


def sample_instance(
    metadata: Mapping[str, Any] | None, prompt: Any = ""
) -> evaluate_pb2.SweInstance:
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
    return evaluate_pb2.SweInstance(**fields)
