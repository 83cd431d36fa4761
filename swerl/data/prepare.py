"""`swerl data prepare`: SWE-bench / SWE-Gym dataset rows into slime's JSONL prompt data.

Each kept row becomes one line `{"text": <problem statement>, "metadata": {"instance": {...every
column...}, "data_source": "..."}}`, which slime reads with `--input-key text --metadata-key
metadata` and the trainer plugin turns into a `swerl.exec.v1.SweInstance`. In the instance the
test lists are real JSON lists (SWE-bench stores them as JSON text) and `image_name` is always
set (see swerl.data.naming). A row that lacks what evaluation needs is skipped, with its reason
written to `skipped.jsonl` and counted in `report.json`, so a bad row never reaches training as
a task nobody can grade.

Sources are Hugging Face `datasets`: a hub name (`princeton-nlp/SWE-bench_Verified`, read through
the local Hugging Face cache when offline), or local parquet / jsonl / json / csv / arrow files,
or a directory written by `Dataset.save_to_disk`.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swerl.data.naming import image_name, is_image_reference, resolve_convention

DATA_FILE = "data.jsonl"
INSTANCE_IDS_FILE = "instance_ids.txt"
IMAGES_FILE = "images.txt"
SKIPPED_FILE = "skipped.jsonl"
REPORT_FILE = "report.json"

_FILE_BUILDERS = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
}
_TEST_LISTS = ("FAIL_TO_PASS", "PASS_TO_PASS")


class DataSourceError(ValueError):
    """A source could not be read (missing file, unknown format, hub dataset not available)."""


class RowProblem(ValueError):
    """A row cannot become a gradable task; `reason` is a stable, countable name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class PrepareReport:
    rows: int = 0
    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    images: int = 0
    by_source: dict[str, int] = field(default_factory=dict)
    # The first skipped row, in one line naming its source, row number and problem.
    first_problem: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "kept": self.kept,
            "skipped": sum(self.skipped.values()),
            "skipped_by_reason": dict(sorted(self.skipped.items())),
            "images": self.images,
            "kept_by_source": self.by_source,
        }

    def render(self) -> str:
        lines = [f"kept {self.kept} of {self.rows} rows ({self.images} distinct images)"]
        if self.skipped:
            total = sum(self.skipped.values())
            counts = sorted(self.skipped.items())
            reasons = ", ".join(f"{reason} {count}" for reason, count in counts)
            lines.append(f"skipped {total}: {reasons}")
        return "\n".join(lines)


def load_rows(
    source: str, *, split: str = "train", cache_dir: Path | None = None
) -> Iterator[dict]:
    """The rows of one source as plain dicts (see the module docstring for what a source is)."""
    import datasets

    # A progress bar per file, and datasets' own log line for a file it cannot read, are noise
    # around swerl's report and its one-line errors.
    datasets.disable_progress_bars()
    datasets_log = logging.getLogger("datasets")
    level = datasets_log.level
    datasets_log.setLevel(logging.CRITICAL)
    path = Path(source).expanduser()
    cache = str(cache_dir) if cache_dir else None
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataSourceError(
                        f"{source}: no split {split!r} (has {', '.join(loaded.keys())})"
                    )
                loaded = loaded[split]
        elif path.is_file():
            suffix = path.suffix.lower()
            if suffix == ".arrow":
                loaded = datasets.Dataset.from_file(str(path))
            elif suffix in _FILE_BUILDERS:
                loaded = datasets.load_dataset(
                    _FILE_BUILDERS[suffix], data_files=str(path), split="train", cache_dir=cache
                )
            else:
                raise DataSourceError(
                    f"{source}: unknown file type {suffix!r} "
                    f"(use {', '.join(sorted({*_FILE_BUILDERS, '.arrow'}))})"
                )
        elif _looks_like_path(source):
            raise DataSourceError(f"{source}: no such file or directory")
        else:
            loaded = datasets.load_dataset(source, split=split, cache_dir=cache)
    except DataSourceError:
        raise
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as exc:
        raise DataSourceError(f"{source}: cannot be loaded: {_one_line(exc)}") from exc
    except datasets.exceptions.DatasetGenerationError as exc:
        # Its own message is generic; the parser's error (e.g. bad JSON) is the cause.
        raise DataSourceError(
            f"{source}: cannot be loaded: {_one_line(exc.__cause__ or exc)}"
        ) from exc
    finally:
        datasets_log.setLevel(level)
    for row in loaded:
        yield dict(row)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def _looks_like_path(source: str) -> bool:
    # Hub names are "owner/name"; anything with a file suffix or a leading ./ / ~ is a path.
    return (
        source.startswith((".", "/", "~"))
        or Path(source).suffix.lower() in {*_FILE_BUILDERS, ".arrow"}
        or source.count("/") > 1
    )


def data_source_name(source: str) -> str:
    """A short label of a source for `metadata.data_source`: the hub name or the file stem."""
    path = Path(source)
    if path.exists():
        return path.stem if path.is_file() else path.name
    return source


def normalize_row(
    row: dict[str, Any], *, convention: str, data_source: str, registry_prefix: str = ""
) -> dict[str, Any]:
    """The instance for the row: JSON-safe values, real test lists, `image_name` set.

    Raises RowProblem when the row cannot be evaluated.
    """
    instance = {str(key): _json_safe(value) for key, value in row.items()}
    instance_id = instance.get("instance_id")
    if not isinstance(instance_id, str) or not instance_id.strip():
        raise RowProblem("MISSING_INSTANCE_ID", "no instance_id")
    for key in ("problem_statement", "base_commit", "test_patch"):
        if not _text(instance.get(key)):
            raise RowProblem(f"MISSING_{key.upper()}", f"{instance_id}: {key} is empty or absent")
    for key in _TEST_LISTS:
        instance[key] = _test_list(instance_id, key, instance.get(key))
    if "version" in instance and instance["version"] is not None:
        instance["version"] = str(instance["version"])
    eval_type = _text(instance.get("eval_type"))
    has_script = bool(_text(instance.get("eval_script")))
    if eval_type == "exit_code":
        if not has_script:
            raise RowProblem("MISSING_EVAL_SCRIPT", f"{instance_id}: eval_type exit_code")
    elif not instance["FAIL_TO_PASS"]:
        raise RowProblem("EMPTY_FAIL_TO_PASS", f"{instance_id}: nothing to grade against")
    if not has_script and not (_text(instance.get("repo")) and _text(instance.get("version"))):
        raise RowProblem(
            "MISSING_EVAL_SPEC",
            f"{instance_id}: needs an eval_script, or repo and version for swebench's script",
        )
    instance["image_name"] = image_name(
        instance, convention=convention, data_source=data_source, registry_prefix=registry_prefix
    )
    if not is_image_reference(instance["image_name"]):
        raise RowProblem(
            "BAD_IMAGE_NAME",
            f"{instance_id}: image_name {instance['image_name']!r} is not a Docker image reference",
        )
    return instance


def row_problem_line(source: str, index: int, problem: RowProblem) -> str:
    """One line naming the source, the row (numbered from 0) and what is wrong with it."""
    return f"{source}: row {index}: {problem.reason}: {problem.detail}"


def slime_line(instance: dict[str, Any], data_source: str) -> dict[str, Any]:
    return {
        "text": instance["problem_statement"],
        "metadata": {"instance": instance, "data_source": data_source},
    }


def prepare(
    sources: Iterable[str],
    out_dir: Path,
    *,
    split: str = "train",
    convention: str = "auto",
    registry_prefix: str = "",
    data_source: str | None = None,
    cache_dir: Path | None = None,
) -> PrepareReport:
    """Writes data.jsonl, instance_ids.txt, images.txt, skipped.jsonl and report.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = PrepareReport()
    seen: set[str] = set()
    images: dict[str, None] = {}
    with (
        (out_dir / DATA_FILE).open("w", encoding="utf-8") as data,
        (out_dir / INSTANCE_IDS_FILE).open("w", encoding="utf-8") as ids,
        (out_dir / SKIPPED_FILE).open("w", encoding="utf-8") as skipped,
    ):
        for source in sources:
            label = data_source or data_source_name(source)
            rule = resolve_convention(convention, label)
            kept_here = 0
            for index, row in enumerate(load_rows(source, split=split, cache_dir=cache_dir)):
                report.rows += 1
                try:
                    instance = normalize_row(
                        row, convention=rule, data_source=label, registry_prefix=registry_prefix
                    )
                    if instance["instance_id"] in seen:
                        raise RowProblem(
                            "DUPLICATE_INSTANCE_ID", f"{instance['instance_id']}: seen before"
                        )
                except RowProblem as problem:
                    report.skipped[problem.reason] += 1
                    entry = {
                        "source": source,
                        "row": index,
                        "instance_id": row.get("instance_id"),
                        "reason": problem.reason,
                        "detail": problem.detail,
                    }
                    skipped.write(json.dumps(entry, default=str) + "\n")
                    if not report.first_problem:
                        report.first_problem = row_problem_line(source, index, problem)
                    continue
                seen.add(instance["instance_id"])
                images[instance["image_name"]] = None
                data.write(json.dumps(slime_line(instance, label), ensure_ascii=False) + "\n")
                ids.write(instance["instance_id"] + "\n")
                report.kept += 1
                kept_here += 1
            report.by_source[source] = kept_here
    (out_dir / IMAGES_FILE).write_text("".join(f"{name}\n" for name in images), encoding="utf-8")
    report.images = len(images)
    (out_dir / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report


def _text(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def _test_list(instance_id: str, key: str, value: Any) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise RowProblem("BAD_TEST_LIST", f"{instance_id}: {key} is not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RowProblem("BAD_TEST_LIST", f"{instance_id}: {key} must be a list of test ids")
    return value


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
