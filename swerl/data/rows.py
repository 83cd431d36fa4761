"""Rows files (SWE-bench / SWE-Gym rows, or a slime JSONL), read as `swerl eval` reads them.

A rows file is parquet, JSON, JSON lines or a saved dataset; a slime JSONL written by `swerl data
prepare` keeps the instance under `metadata.instance`. Every row gets the checks and image names of
`swerl data prepare`; rows that cannot be graded are counted by reason and left out. Both `swerl
eval` (swerl.evaluation.dataset) and task sets (swerl.tasks.load_task_source) read rows here.
"""

from __future__ import annotations

import json
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


def load_rows_file(
    source: Path, *, convention: str = "auto", registry_prefix: str = "", split: str = "train"
) -> LoadedDataset:
    """The gradable instances of a rows file, and the rows left out (see the module doc)."""
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
