"""Reads a run for `swerl inspect`: an eval output directory (results.jsonl + artifacts/) or an
agent artifact directory (one `<instance>__<episode>/` folder per episode with meta.json,
traj.json, patch.diff and, for token-exact policies, tokens.json).

The index (one summary per episode, with the lowered text of its actions and outputs for
search) is built once when the run is opened; an episode's full record is read on demand.
Nothing here knows about HTTP.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swerl.agent.gateway.artifacts import SESSION_KIND
from swerl.agent.loop.artifacts import SESSION_FILE
from swerl.web.sessions import session_tree

RESULTS_FILE = "results.jsonl"
ARTIFACTS_DIR = "artifacts"
SORT_KEYS = ("instance", "status", "reward", "turns", "tokens", "duration", "prm")


class RunNotFound(Exception):
    """The path is not a run: no results.jsonl and no episode folders with meta.json."""


class EpisodeNotFound(KeyError):
    """No episode with that key in the run."""


@dataclass
class EpisodeSummary:
    key: str  # the episode's artifact folder name, or its episode id when it has none
    episode_id: str
    instance_id: str
    status: str
    reward: float | None
    turns: int
    tokens: int
    duration_s: float
    prm_mean: float | None
    eval_status: str
    artifact_dir: Path | None
    error: str = ""  # "REASON: message" of an infra error or abort
    search_text: str = field(repr=False, default="")


@dataclass
class Page:
    episodes: list[EpisodeSummary]
    total: int  # episodes that match the filters
    page: int
    pages: int


@dataclass
class TokenSpan:
    token_id: int
    text: str
    trained: bool  # loss mask 1: the policy sampled it
    logprob: float | None
    turn: int  # index of the policy turn this token belongs to or follows (-1: the prompt)
    turn_start: bool  # first token of a policy turn


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _prm_mean(scores: list[dict[str, Any]]) -> float | None:
    values = [
        float(s.get("score", 0.0)) for s in scores if s.get("state") == "STEP_SCORE_STATE_SCORED"
    ]
    return statistics.fmean(values) if values else None


def _token_count(tokens: dict[str, Any] | None) -> int:
    if not tokens:
        return 0
    record = tokens.get("trajectory") or (tokens.get("chains") or [None])[-1]
    if record:
        return len(record["prompt_ids"]) + len(record["response_ids"])
    turns = tokens.get("turns") or []
    if turns:
        last = turns[-1]
        return len(last["prompt_ids"]) + len(last["response_ids"])
    return 0


def _search_text(traj: dict[str, Any] | None) -> str:
    if not traj:
        return ""
    # The system prompt and the problem statement are the same for many episodes: searching
    # them would match everything, so only what happened after them counts.
    messages = traj.get("messages") or []
    return "\n".join(str(m.get("content", "")) for m in messages[2:]).lower()


class Run:
    """One opened run; `index` is fixed once built."""

    def __init__(self, path: Path, index: list[EpisodeSummary], kind: str) -> None:
        self.path = path
        self.kind = kind  # "eval" or "artifacts"
        self.index = index
        self._by_key = {e.key: e for e in index}

    @classmethod
    def open(cls, path: Path) -> Run:
        path = Path(path)
        if not path.is_dir():
            raise RunNotFound(f"{path}: no such directory")
        if (path / RESULTS_FILE).exists():
            return cls(path, list(_eval_index(path)), "eval")
        folders = [d for d in sorted(path.iterdir()) if (d / "meta.json").exists()]
        if folders:
            return cls(path, [_artifact_summary(d, {}) for d in folders], "artifacts")
        raise RunNotFound(
            f"{path}: not a run (no {RESULTS_FILE}, and no episode folders with meta.json)"
        )

    def episode(self, key: str) -> EpisodeSummary:
        try:
            return self._by_key[key]
        except KeyError:
            raise EpisodeNotFound(key) from None

    def statuses(self) -> list[str]:
        return sorted({e.status for e in self.index})

    def query(
        self,
        *,
        status: str = "",
        reward: str = "",
        instance: str = "",
        search: str = "",
        sort: str = "instance",
        descending: bool = False,
        page: int = 1,
        per_page: int = 50,
    ) -> Page:
        predicates: list[Callable[[EpisodeSummary], bool]] = []
        if status:
            predicates.append(lambda e: e.status == status)
        if reward:
            if reward == "none":
                predicates.append(lambda e: e.reward is None)
            else:
                wanted = float(reward)
                predicates.append(lambda e: e.reward is not None and e.reward == wanted)
        if instance:
            needle = instance.lower()
            predicates.append(lambda e: needle in e.instance_id.lower())
        if search:
            text = search.lower()
            predicates.append(lambda e: text in e.search_text)
        chosen = [e for e in self.index if all(p(e) for p in predicates)]
        chosen.sort(key=_sort_key(sort), reverse=descending)
        per_page = max(1, per_page)
        pages = max(1, -(-len(chosen) // per_page))
        page = min(max(1, page), pages)
        start = (page - 1) * per_page
        return Page(chosen[start : start + per_page], len(chosen), page, pages)

    def detail(self, key: str) -> dict[str, Any]:
        """Everything the episode page shows, read from the episode's files."""
        summary = self.episode(key)
        folder = summary.artifact_dir
        meta = (_read_json(folder / "meta.json") if folder else None) or {}
        traj = (_read_json(folder / "traj.json") if folder else None) or {}
        patch = ""
        if folder and (folder / "patch.diff").exists():
            patch = (folder / "patch.diff").read_text(encoding="utf-8", errors="replace")
        messages = traj.get("messages") or []
        steps = traj.get("steps") or []
        scores = {int(s.get("turnIndex", 0)): s for s in meta.get("step_scores") or []}
        observations = _observations(messages[2:])
        turns = []
        for i, step in enumerate(steps):
            turn = int(step.get("turn", i))
            turns.append(
                {
                    # A format-error turn ran nothing: it has no action, exit code or timing.
                    "action": "",
                    "response": "",
                    "exit_code": None,
                    "exec_s": None,
                    "output_bytes": 0,
                    "timed_out": False,
                    "format_error": False,
                    **step,
                    **_tool_action(step),
                    "turn": turn,
                    "output": observations[i] if i < len(observations) else "",
                    "score": scores.get(turn),
                }
            )
        problem = messages[1]["content"] if len(messages) > 1 else ""
        report = meta.get("report") or {}
        tests: list[dict[str, str]] = []
        for group, label in (("failToPass", "FAIL_TO_PASS"), ("passToPass", "PASS_TO_PASS")):
            for outcome, names in (report.get(group) or {}).items():
                tests.extend({"group": label, "outcome": outcome, "name": n} for n in names)
        return {
            "summary": summary,
            "meta": meta,
            "info": traj.get("info") or {},
            "problem": problem,
            "system": messages[0]["content"] if messages else "",
            "turns": turns,
            "patch_lines": _diff_lines(patch),
            "report": report,
            "tests": tests,
            "has_tokens": bool(folder and (folder / "tokens.json").exists()),
            # A gateway session's call tree (a session folder, or a harness episode's session).
            "session": session_tree(_read_json(folder / SESSION_FILE)) if folder else None,
            "is_session": meta.get("kind") == SESSION_KIND,
        }

    def tokens(self, key: str) -> dict[str, Any] | None:
        summary = self.episode(key)
        if summary.artifact_dir is None:
            return None
        data = _read_json(summary.artifact_dir / "tokens.json")
        return data if isinstance(data, dict) else None


def _observations(messages: list[dict[str, Any]]) -> list[str]:
    """What answered each reply: a user message (bash blocks), or the tool messages of the
    `tool_calls` protocol, one section per call."""
    out: list[str] = []
    current: list[str] | None = None
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            current = []
            out.append("")
            continue
        if current is None:
            continue
        if role == "tool":
            current.append(f"[{message.get('name', 'tool')} {message.get('tool_call_id', '')}]")
        current.append(str(message.get("content") or ""))
        out[-1] = "\n".join(current)
    return out


def _tool_action(step: dict[str, Any]) -> dict[str, Any]:
    """A tool-call step's calls as its action, one per line (the bash protocol has `action`)."""
    calls = step.get("tool_calls")
    if not isinstance(calls, list) or step.get("action"):
        return {}
    lines = [f"{c.get('name', '')}: {c.get('command') or ''}".rstrip(": ") for c in calls]
    exits = [c.get("exit_code") for c in calls if c.get("exit_code") is not None]
    fields: dict[str, Any] = {"action": "\n".join(lines)}
    if exits:
        fields["exit_code"] = exits[-1]
    return fields


def _sort_key(name: str) -> Callable[[EpisodeSummary], Any]:
    if name not in SORT_KEYS:
        raise ValueError(f"unknown sort key {name!r}; one of {', '.join(SORT_KEYS)}")
    attribute = {"instance": "instance_id", "duration": "duration_s", "prm": "prm_mean"}.get(
        name, name
    )

    def key(e: EpisodeSummary) -> Any:
        value = getattr(e, attribute)
        # Missing numbers (no reward, no PRM) sort before every number.
        return (value is not None, value if value is not None else 0, e.instance_id)

    return key


def _diff_lines(patch: str) -> list[tuple[str, str]]:
    lines = []
    for line in patch.splitlines():
        if line.startswith(("+++", "---", "diff --git", "index ")):
            kind = "file"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "add"
        elif line.startswith("-"):
            kind = "del"
        else:
            kind = "ctx"
        lines.append((kind, line))
    return lines


def _error(source: dict[str, Any]) -> str:
    reason = str(source.get("error_reason") or "")
    message = str(source.get("error_message") or "")
    return f"{reason}: {message}" if reason and message else reason or message


def _artifact_summary(folder: Path, record: dict[str, Any]) -> EpisodeSummary:
    meta = _read_json(folder / "meta.json") or {}
    traj = _read_json(folder / "traj.json")
    tokens = _read_json(folder / "tokens.json") if (folder / "tokens.json").exists() else None
    metrics = meta.get("metrics") or record.get("metrics") or {}
    report = meta.get("report") or {}
    return EpisodeSummary(
        key=folder.name,
        episode_id=str(meta.get("episode_id") or record.get("episode_id") or folder.name),
        instance_id=str(meta.get("instance_id") or record.get("instance_id") or ""),
        status=str(record.get("status") or meta.get("status") or "UNKNOWN"),
        reward=record["reward"] if "reward" in record else meta.get("reward"),
        turns=int(metrics.get("turns", 0)),
        tokens=_token_count(tokens),
        duration_s=float(record.get("duration_s") or metrics.get("total_time") or 0.0),
        prm_mean=_prm_mean(meta.get("step_scores") or []),
        eval_status=str(
            record.get("eval_status")
            or str(report.get("status", "")).removeprefix("EVALUATION_STATUS_")
        ),
        artifact_dir=folder,
        error=_error(record) or _error((traj or {}).get("info") or {}),
        search_text=_search_text(traj),
    )


def _eval_index(path: Path) -> Iterable[EpisodeSummary]:
    latest: dict[str, dict[str, Any]] = {}
    for line in (path / RESULTS_FILE).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash; swerl eval runs that instance again
        if isinstance(record, dict) and "instance_id" in record:
            latest[str(record["instance_id"])] = record
    for record in latest.values():
        folder = _artifact_folder(path, record)
        if folder is not None:
            yield _artifact_summary(folder, record)
            continue
        metrics = record.get("metrics") or {}
        yield EpisodeSummary(
            key=str(record.get("episode_id") or record["instance_id"]),
            episode_id=str(record.get("episode_id") or ""),
            instance_id=str(record["instance_id"]),
            status=str(record.get("status") or "UNKNOWN"),
            reward=record.get("reward"),
            turns=int(metrics.get("turns", 0)),
            tokens=0,
            duration_s=float(record.get("duration_s") or 0.0),
            prm_mean=None,
            eval_status=str(record.get("eval_status") or ""),
            artifact_dir=None,
            error=_error(record),
        )


def _artifact_folder(path: Path, record: dict[str, Any]) -> Path | None:
    # The run may have been moved since: try the folder of the same name under artifacts/ first.
    recorded = str(record.get("artifact_dir") or "")
    candidates = []
    if recorded:
        candidates += [path / ARTIFACTS_DIR / Path(recorded).name, Path(recorded)]
    for folder in candidates:
        if (folder / "meta.json").exists():
            return folder
    return None


def token_spans(record: dict[str, Any], decode: Callable[[int], str]) -> list[TokenSpan]:
    """The tokens of one record in order, the prompt then the response, each with its mask and
    logprob; a policy turn starts where the loss mask goes from 0 to 1."""
    spans = [
        TokenSpan(int(t), decode(int(t)), False, None, -1, False) for t in record["prompt_ids"]
    ]
    mask = record.get("loss_mask") or []
    logprobs = record.get("logprobs") or []
    turn = -1
    previous = 0
    for i, token in enumerate(record["response_ids"]):
        trained = bool(mask[i]) if i < len(mask) else False
        start = trained and not previous
        if start:
            turn += 1
        previous = int(trained)
        logprob = float(logprobs[i]) if trained and i < len(logprobs) else None
        spans.append(TokenSpan(int(token), decode(int(token)), trained, logprob, turn, start))
    return spans
