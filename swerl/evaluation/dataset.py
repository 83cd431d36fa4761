"""The instances `swerl eval` runs: read from a dataset, then filtered, shuffled and sliced.

A source is a tasks directory (one `instance.json` per subdirectory, like examples/tasks), a
slime JSONL written by `swerl data prepare` (the instance under `metadata.instance`), or raw
SWE-bench / SWE-Gym rows in any format `swerl data prepare` reads. Raw rows get the same checks
and image names as there; rows that cannot be graded are reported and left out.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swerl.data.prepare import (
    RowProblem,
    data_source_name,
    load_rows,
    normalize_row,
    row_problem_line,
)


@dataclass(frozen=True)
class EvalInstance:
    instance: dict[str, Any]
    data_source: str

    @property
    def instance_id(self) -> str:
        return str(self.instance["instance_id"])


@dataclass
class LoadedDataset:
    instances: list[EvalInstance]
    skipped: Counter[str] = field(default_factory=Counter)
    # The first skipped row, in one line naming its source, row number and problem.
    first_problem: str = ""


def load_instances(
    source: Path, *, convention: str = "auto", registry_prefix: str = "", split: str = "train"
) -> LoadedDataset:
    if source.is_dir() and not (source / "dataset_info.json").exists():
        from swerl.tasks import load_tasks

        label = source.name
        return LoadedDataset([EvalInstance(dict(t.instance), label) for t in load_tasks(source)])
    label = data_source_name(str(source))
    loaded = LoadedDataset([])
    seen: set[str] = set()
    for index, row in enumerate(_rows(source, split)):
        metadata = row.get("metadata")
        if isinstance(metadata, dict) and isinstance(metadata.get("instance"), dict):
            raw, row_label = metadata["instance"], str(metadata.get("data_source") or label)
        else:
            raw, row_label = row, label
        try:
            instance = normalize_row(
                raw, convention=convention, data_source=row_label, registry_prefix=registry_prefix
            )
            if instance["instance_id"] in seen:
                raise RowProblem("DUPLICATE_INSTANCE_ID", instance["instance_id"])
        except RowProblem as problem:
            loaded.skipped[problem.reason] += 1
            if not loaded.first_problem:
                loaded.first_problem = row_problem_line(str(source), index, problem)
            continue
        seen.add(instance["instance_id"])
        loaded.instances.append(EvalInstance(instance, row_label))
    return loaded


def _rows(source: Path, split: str):
    # JSON lines are read as they are: `datasets` would unify every row to one Arrow schema,
    # filling the columns a row lacks (instances differ) with nulls.
    if source.is_file() and source.suffix.lower() == ".jsonl":
        with source.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{source}:{number}: not JSON: {exc}") from None
        return
    yield from load_rows(str(source), split=split)


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
