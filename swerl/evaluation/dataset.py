"""The instances `swerl eval` runs: read from a dataset, then filtered, shuffled and sliced.

A source is a tasks directory (one `instance.json` per subdirectory, like examples/tasks), a
slime JSONL written by `swerl data prepare` (the instance under `metadata.instance`), or raw
SWE-bench / SWE-Gym rows in any format `swerl data prepare` reads. Raw rows get the same checks
and image names as there; rows that cannot be graded are reported and left out.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from swerl.data.rows import EvalInstance, LoadedDataset, load_rows_file
from swerl.tasks import load_tasks

__all__ = ["EvalInstance", "LoadedDataset", "load_instances", "parse_slice", "select"]


def load_instances(
    source: Path, *, convention: str = "auto", registry_prefix: str = "", split: str = "train"
) -> LoadedDataset:
    if source.is_dir() and not (source / "dataset_info.json").exists():
        label = source.name
        return LoadedDataset([EvalInstance(dict(t.instance), label) for t in load_tasks(source)])
    return load_rows_file(
        source, convention=convention, registry_prefix=registry_prefix, split=split
    )


def select(
    instances: list[EvalInstance],
    *,
    instance_ids: list[str] | None = None,
    pattern: str | None = None,
    shuffle: bool = False,
    seed: int = 0,
    slice_spec: str | None = None,
) -> list[EvalInstance]:
    """Keeps the named ids and ids matching `pattern`, shuffles (seeded), then slices
    (`START:STOP`, python style, either side optional)."""
    chosen = list(instances)
    if instance_ids:
        wanted = set(instance_ids)
        chosen = [i for i in chosen if i.instance_id in wanted]
    if pattern:
        regex = re.compile(pattern)
        chosen = [i for i in chosen if regex.search(i.instance_id)]
    if shuffle:
        random.Random(seed).shuffle(chosen)
    if slice_spec:
        chosen = chosen[parse_slice(slice_spec)]
    return chosen


def parse_slice(spec: str) -> slice:
    parts = spec.split(":")
    if len(parts) != 2:
        raise ValueError(f"slice must look like START:STOP, got {spec!r}")
    try:
        start, stop = (int(p) if p.strip() else None for p in parts)
    except ValueError:
        raise ValueError(f"slice must look like START:STOP, got {spec!r}") from None
    return slice(start, stop)
