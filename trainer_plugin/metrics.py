"""The seeds' `agent/*` rollout metrics, aggregated over the episodes of a batch.

slime hands the log function the flattened samples; with dynamic history an episode has one
sample per turn, so samples are first reduced to episodes (by `rollout_id`) and every episode
counts once. A metric is aggregated only over the episodes that report it (the agent leaves out
what does not apply, e.g. `eval_time` for an episode that was not graded), and a key no episode
reports is not emitted at all rather than logged as 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from swerl.trainer_plugin import convert, reruns

# Per-episode metric → aggregates, named as in the seed (slime's swe-agent example).
_SUMMED = ("turns", "tool_calls")  # agent/<k>_mean and agent/<k>_sum
_TOOL_PREFIXES = ("tool_calls_", "tool_parse_failures", "format_errors")
_MEAN_SUFFIXED = (  # agent/<k>_mean
    "model_query_time_sum",
    "env_execution_time_sum",
    "eval_time",
    "overhead_time",
    "agent_run_time",
)
_MEAN_PLAIN = (  # agent/<k>: per-episode averages and ratios, averaged again
    "time_per_turn",
    "model_query_time_avg",
    "env_execution_time_avg",
    "model_time_ratio",
    "env_time_ratio",
    "eval_time_ratio",
)

# Every key the seed logged (SLIME_CONTRACT.md), for tests and docs.
SEED_METRIC_KEYS = (
    "agent/turns_mean",
    "agent/turns_sum",
    "agent/tool_calls_mean",
    "agent/tool_calls_sum",
    "agent/total_time_mean",
    "agent/total_time_max",
    "agent/total_time_min",
    "agent/model_query_time_sum_mean",
    "agent/env_execution_time_sum_mean",
    "agent/eval_time_mean",
    "agent/overhead_time_mean",
    "agent/time_per_turn",
    "agent/model_query_time_avg",
    "agent/env_execution_time_avg",
    "agent/model_time_ratio",
    "agent/env_time_ratio",
    "agent/agent_run_time_mean",
    "agent/eval_time_ratio",
)


def flatten(samples: Iterable[Any]) -> list[Any]:
    """Samples with any nesting of lists (slime's groups of fan-out lists) flattened."""
    flat: list[Any] = []
    for item in samples:
        if isinstance(item, (list, tuple)):
            flat.extend(flatten(item))
        else:
            flat.append(item)
    return flat


def episode_key(sample: Any) -> Any:
    """What identifies the episode of a sample: its rollout id, else the sample itself."""
    metadata = getattr(sample, "metadata", None) or {}
    key = metadata.get(convert.ROLLOUT_ID)
    if key is None:
        key = getattr(sample, "rollout_id", None)
    return key if key is not None else ("sample", id(sample))


def episodes(samples: Iterable[Any]) -> list[Any]:
    """One representative sample per episode, in first-seen order."""
    seen: dict[Any, Any] = {}
    for sample in flatten(samples):
        seen.setdefault(episode_key(sample), sample)
    return list(seen.values())


# Episode statuses of episodes that ended without a grade the policy earned.
_UNGRADED_STATUSES = ("CANCELLED", "ABORTED", "NO_RESULT")


def split_graded(samples: Sequence[Any]) -> tuple[list[int], int, int]:
    """(indices of the samples whose episode was graded, infra failures, cancelled episodes).

    Samples without the plugin's metadata (another generate function's) count as graded.
    """
    kept: list[int] = []
    infra = cancelled = 0
    for i, sample in enumerate(samples):
        meta = getattr(sample, "metadata", None) or {}
        if meta.get(convert.INFRA_ERROR):
            infra += 1
        elif meta.get(convert.EPISODE_STATUS) in _UNGRADED_STATUSES:
            cancelled += 1
        else:
            kept.append(i)
    return kept, infra, cancelled


@dataclass(frozen=True)
class EvalGroups:
    """What `complete_groups` kept of one eval dataset's samples."""

    kept: list[int]  # indices (in the list given) of the samples of complete, graded groups
    infra: int  # episodes that ended in an infra failure
    cancelled: int  # episodes cancelled or aborted (never graded)
    incomplete: int  # prompt groups left out (a member ungraded or missing)
    graded_left_out: int  # graded episodes left out with their group


def complete_groups(samples: Sequence[Any], size: int) -> EvalGroups:
    """The samples of the prompt groups of one eval dataset whose `size` members were all
    graded. A member's group is `index // size` (the frameworks number an eval dataset's samples
    0.. in prompt order, n per prompt); a sample without an int index is grouped by position."""
    graded, infra, cancelled = split_graded(samples)
    graded_set = set(graded)
    members: dict[int, list[int]] = {}
    for position, sample in enumerate(samples):
        index = getattr(sample, "index", None)
        block = (index if isinstance(index, int) else position) // max(size, 1)
        members.setdefault(block, []).append(position)
    kept: list[int] = []
    incomplete = left_out = 0
    for positions in members.values():
        if len(positions) == size and all(p in graded_set for p in positions):
            kept.extend(positions)
        else:
            incomplete += 1
            left_out += sum(p in graded_set for p in positions)
    return EvalGroups(sorted(kept), infra, cancelled, incomplete, left_out)


def agent_metrics(samples: Sequence[Any]) -> dict[str, float]:
    """The `agent/*` metrics of a batch of samples (each episode once)."""
    per_episode = [
        (getattr(s, "metadata", None) or {}).get(convert.AGENT_METRICS) or {}
        for s in episodes(samples)
    ]

    def values(key: str) -> list[float]:
        return [float(m[key]) for m in per_episode if key in m]

    out: dict[str, float] = {}
    # The tool_calls protocol's counts: calls per tool (tool_calls_<tool>), calls that could
    # not be run as written and format-error replies, summed like tool_calls.
    tool_keys = sorted(
        {k for m in per_episode for k in m if k.startswith(_TOOL_PREFIXES) and k != "tool_calls"}
    )
    for key in (*_SUMMED, *tool_keys):
        if found := values(key):
            out[f"agent/{key}_mean"] = sum(found) / len(found)
            out[f"agent/{key}_sum"] = sum(found)
    for key in _MEAN_SUFFIXED:
        if found := values(key):
            out[f"agent/{key}_mean"] = sum(found) / len(found)
    for key in _MEAN_PLAIN:
        if found := values(key):
            out[f"agent/{key}"] = sum(found) / len(found)
    if found := values("total_time"):
        out["agent/total_time_mean"] = sum(found) / len(found)
        out["agent/total_time_max"] = max(found)
        out["agent/total_time_min"] = min(found)
    out.update(_outcome_metrics(samples))
    return out


def _outcome_metrics(samples: Sequence[Any]) -> dict[str, float]:
    """How episodes ended: counts that tell infra trouble apart from policy quality."""
    reps = episodes(samples)
    if not reps:
        return {}
    metas = [getattr(s, "metadata", None) or {} for s in reps]
    n = len(metas)
    statuses = [m.get(convert.EPISODE_STATUS) for m in metas]
    graded = [m for m in metas if m.get(convert.OUTCOME_REWARD) is not None]
    out = {
        "agent/episodes": float(n),
        "agent/infra_error_ratio": sum(bool(m.get(convert.INFRA_ERROR)) for m in metas) / n,
        "agent/aborted_ratio": sum(s in ("CANCELLED", "ABORTED") for s in statuses) / n,
        "agent/submitted_ratio": statuses.count("SUBMITTED") / n,
        "agent/truncated_ratio": sum(bool(s and s.startswith("LIMIT_")) for s in statuses) / n,
    }
    if graded:
        resolved = sum(float(m[convert.OUTCOME_REWARD]) > 0 for m in graded)
        out["agent/resolved_ratio"] = resolved / len(graded)
    out.update(_rerun_metrics(metas))
    return out


def _rerun_metrics(metas: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Infra re-runs (reruns.py), over the episodes that report their attempts: the mean
    attempts, the extra episodes run, and the share of re-run episodes that then succeeded
    (ended other than in an infra failure; only when some were re-run)."""
    counted = [m for m in metas if isinstance(m.get(reruns.EPISODE_ATTEMPTS), int)]
    if not counted:
        return {}
    attempts = [int(m[reruns.EPISODE_ATTEMPTS]) for m in counted]
    out = {
        "agent/episode_attempts_mean": sum(attempts) / len(attempts),
        "agent/infra_reruns_sum": float(sum(a - 1 for a in attempts)),
    }
    rerun = [m for m in counted if int(m[reruns.EPISODE_ATTEMPTS]) > 1]
    if rerun:
        recovered = sum(not m.get(convert.INFRA_ERROR) for m in rerun)
        out["agent/infra_recovered_ratio"] = recovered / len(rerun)
    return out
