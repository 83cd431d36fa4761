"""The output directory of `swerl eval`: results.jsonl (the record, appended as episodes end),
and preds.jsonl + summary.json (derived from it at the end of every run).

results.jsonl is the source of truth and the resume point: one line per finished episode,
flushed and fsynced as it ends, so an interrupted run loses only the episodes still running.
When an instance has several episodes (an error retried), the last one counts. Errors (infra
failures, aborted generations) are kept apart from answers: they are not counted as unresolved,
and `--retry-errors` runs them again.

Best-of-n (`--branch-at K --branches N`): an episode writes one line per branch (`branch`,
`sampling_seed`), appended together when the episode ends. The instance's record combines them
(`combine`): resolved when any branch resolved (pass@n), an error when none resolved and some
branch ended in error (its answer is unknown), otherwise the answer of its first branch; the
summary adds `pass_at_n` and the estimate `pass_at_1` (per instance, the share of its answered
branches that resolved, averaged over the selected instances).

A graded record also says how it was graded: the evaluation's network (`eval_network`: NONE,
BRIDGE or HOST), the package index its install steps used (`eval_package_index`, empty for
pip's default) and the report's warnings (`eval_warnings`: reason and message each, e.g. a
NETWORK_STEP_FAILED of a task that needs network graded offline), taken from the report in the
episode's artifacts/meta.json when the record is appended. summary.json counts them.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_FILE = "results.jsonl"
PREDS_FILE = "preds.jsonl"
SUMMARY_FILE = "summary.json"
ARTIFACTS_DIR = "artifacts"

# Episode outcomes that say nothing about the model: not graded, retryable.
ERROR_STATUSES = frozenset({"INFRA_ERROR", "ABORTED"})


@dataclass
class OutputDir:
    path: Path

    def __post_init__(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / ARTIFACTS_DIR).mkdir(exist_ok=True)

    @property
    def artifacts(self) -> Path:
        return self.path / ARTIFACTS_DIR

    def records(self) -> dict[str, dict[str, Any]]:
        """The record of every instance in results.jsonl: its latest episode's (the lines of
        a branching episode combined, see `combine`)."""
        latest: dict[str, list[dict[str, Any]]] = {}
        file = self.path / RESULTS_FILE
        if not file.exists():
            return {}
        for line in file.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash mid-write; that instance runs again
            rows = latest.setdefault(str(record["instance_id"]), [])
            if rows and rows[-1].get("episode_id") != record.get("episode_id"):
                rows.clear()  # a later episode of the instance replaces the earlier one
            rows.append(record)
        return {iid: combine(rows) for iid, rows in latest.items()}

    def finished(self, *, retry_errors: bool) -> set[str]:
        """Instances a resumed run skips."""
        return {
            iid
            for iid, record in self.records().items()
            if not (retry_errors and record["status"] in ERROR_STATUSES)
        }

    def append(self, *records: dict[str, Any]) -> None:
        """Appends an episode's records (one, or one per branch) in one write, each with how it
        was graded (evaluation_context)."""
        records = tuple({**r, **evaluation_context(r)} for r in records)
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        with (self.path / RESULTS_FILE).open("a", encoding="utf-8") as out:
            out.write(lines)
            out.flush()
            os.fsync(out.fileno())

    def write_derived(self, selected: list[str], model: str, info: dict[str, Any]) -> dict:
        """Writes preds.jsonl and summary.json for the `selected` instances; returns the summary."""
        records = self.records()
        # Records written before they carried the evaluation's network get it here.
        chosen = [
            {**records[iid], **evaluation_context(records[iid])}
            for iid in selected
            if iid in records
        ]
        with (self.path / PREDS_FILE).open("w", encoding="utf-8") as preds:
            for record in chosen:
                if record["status"] in ERROR_STATUSES:
                    continue  # no answer: re-run, not scored as an empty patch
                line = {
                    "instance_id": record["instance_id"],
                    "model_name_or_path": model,
                    "model_patch": record.get("patch", ""),
                }
                preds.write(json.dumps(line, ensure_ascii=False) + "\n")
        summary = summarize(chosen, total=len(selected))
        summary.update(model_name_or_path=model, **info)
        (self.path / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One instance's record from its episode's rows: the row itself without branching; with
    branches, the first resolved branch's row (else the first answered one's), resolved when
    any branch resolved, an error when none resolved and some branch ended in error, and the
    rows themselves under `branches`."""
    if len(rows) == 1 and "branch" not in rows[0]:
        return rows[0]
    resolved = [r for r in rows if r.get("resolved")]
    answered = [r for r in rows if r["status"] not in ERROR_STATUSES]
    errors = [r for r in rows if r["status"] in ERROR_STATUSES]
    best = (resolved or (errors if errors else answered) or rows)[0]
    combined = dict(best)
    combined["resolved"] = bool(resolved)
    combined["branches"] = rows
    return combined


def pass_at_1(record: dict[str, Any]) -> float:
    """The share of the instance's answered branches (or its one answer) that resolved."""
    rows = record.get("branches") or [record]
    answered = [r for r in rows if r["status"] not in ERROR_STATUSES]
    return sum(bool(r.get("resolved")) for r in answered) / len(answered) if answered else 0.0


def summarize(records: list[dict[str, Any]], *, total: int) -> dict[str, Any]:
    by_status = Counter(r["status"] for r in records)
    by_eval = Counter(r["eval_status"] for r in records if r.get("eval_status"))
    resolved = sum(1 for r in records if r.get("resolved"))
    errors = sum(by_status[s] for s in ERROR_STATUSES)
    graded = sum(1 for r in records if r.get("eval_status"))
    sums: dict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    for row in (row for record in records for row in record.get("branches") or [record]):
        for key, value in (row.get("metrics") or {}).items():
            sums[key] += float(value)
            counts[key] += 1
    branched = [r for r in records if "branches" in r]
    best_of: dict[str, float] = {}
    if branched:
        best_of["branches"] = max(len(r["branches"]) for r in branched)
        best_of["pass_at_n"] = resolved / total if total else 0.0
        best_of["pass_at_1"] = sum(pass_at_1(r) for r in records) / total if total else 0.0
    return {
        **best_of,
        "instances": total,
        "completed": len(records) - errors,
        "not_run": total - len(records),
        "resolved": resolved,
        # SWE-bench's figure: every selected instance counts, unresolved unless resolved.
        "resolve_rate": resolved / total if total else 0.0,
        "graded": graded,
        "resolve_rate_of_graded": resolved / graded if graded else 0.0,
        "errors": errors,
        "by_status": dict(sorted(by_status.items())),
        "by_eval_status": dict(sorted(by_eval.items())),
        "metrics_mean": {key: sums[key] / counts[key] for key in sorted(sums)},
        **_evaluation_context_summary(records),
    }


def evaluation_context(record: dict[str, Any]) -> dict[str, Any]:
    """`eval_network`, `eval_package_index` and `eval_warnings` of a graded record, from the
    evaluation report its episode wrote to <artifact_dir>/meta.json; nothing when the record
    has them already, was not graded, or its artifacts are not readable here (a remote agent's
    host)."""
    if "eval_network" in record or not record.get("eval_status") or not record.get("artifact_dir"):
        return {}
    try:
        meta = json.loads((Path(record["artifact_dir"]) / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    report = meta.get("report") if isinstance(meta, dict) else None
    if not isinstance(report, dict):
        return {}
    # meta.json holds the report as MessageToDict writes it: camelCase, defaults left out
    # (an unset network is NETWORK_MODE_UNSPECIFIED, which the exec node treats as NONE).
    network = str(report.get("network") or "NETWORK_MODE_NONE").removeprefix("NETWORK_MODE_")
    warnings = [
        {"reason": str(w.get("reason", "")), "message": str(w.get("message", ""))}
        for w in report.get("warnings") or []
        if isinstance(w, dict)
    ]
    return {
        "eval_network": "NONE" if network == "UNSPECIFIED" else network,
        "eval_package_index": str(report.get("packageIndex") or ""),
        "eval_warnings": warnings,
    }


def _evaluation_context_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """How the graded records were graded: networks, and warnings by reason."""
    networks = Counter(r["eval_network"] for r in records if r.get("eval_network"))
    indexes = Counter(r["eval_package_index"] for r in records if r.get("eval_package_index"))
    warned = [r for r in records if r.get("eval_warnings")]
    reasons = Counter(w["reason"] for r in warned for w in r["eval_warnings"])
    return {
        "by_eval_network": dict(sorted(networks.items())),
        "by_eval_package_index": dict(sorted(indexes.items())),
        "eval_warnings_by_reason": dict(sorted(reasons.items())),
        "instances_with_eval_warnings": sorted(str(r["instance_id"]) for r in warned),
    }
