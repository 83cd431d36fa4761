"""Step scores on the right turns, and the rewards made from them; pure functions, no gRPC.

The agent judges each executed turn concurrently with the rest of the episode, so verdicts come
back out of order and some turns (format errors) are never sent. Keying every verdict by its turn
index and giving every turn an entry (a format error that was not judged is NOT_JUDGED, a judged
turn whose verdict never came is FAILED) is what keeps a score from sliding onto the next turn.

Rewards, as in the seeds' PRM recipe: the whole-trajectory reward is
`outcome + coef * mean(usable step scores)`; each turn's step-wise reward is
`step score + outcome` (`step_scores_with_outcome`), or `outcome + coef * step score` when a
weight is given (`turn_rewards`). A turn without a usable score contributes nothing: its entry is
the outcome alone, and it takes no part in the mean.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from swerl.prm.votes import JudgeState, Verdict


class StepState(enum.Enum):
    """State of a turn's PRM score (mirrors swerl.agent.v1.StepScoreState)."""

    SCORED = "SCORED"
    NO_VALID_VOTES = "NO_VALID_VOTES"
    FAILED = "FAILED"
    NOT_JUDGED = "NOT_JUDGED"


_FROM_JUDGE = {
    JudgeState.SCORED: StepState.SCORED,
    JudgeState.NO_VALID_VOTES: StepState.NO_VALID_VOTES,
    JudgeState.FAILED: StepState.FAILED,
}


class TurnLike(Protocol):
    """What scoring needs of an agent turn: its index and whether it was a format error."""

    @property
    def index(self) -> int: ...

    @property
    def format_error(self) -> bool: ...


@dataclass(frozen=True)
class TurnRef:
    """A plain TurnLike, for callers whose turn records name things differently."""

    index: int
    format_error: bool = False


@dataclass(frozen=True)
class StepScore:
    turn_index: int
    state: StepState
    score: float = 0.0
    valid_votes: int = 0

    @property
    def usable(self) -> bool:
        return self.state is StepState.SCORED


def step_score_of(turn_index: int, verdict: Verdict) -> StepScore:
    scored = verdict.state is JudgeState.SCORED
    return StepScore(
        turn_index=turn_index,
        state=_FROM_JUDGE[verdict.state],
        score=verdict.score if scored else 0.0,
        valid_votes=verdict.valid_votes,
    )


def attach_step_scores(
    turns: Sequence[TurnLike], verdicts: Mapping[int, Verdict]
) -> list[StepScore]:
    """One StepScore per turn, ordered by turn index, each from the verdict keyed by its index.

    A turn without a verdict is NOT_JUDGED when it was a format error (nothing ran, so it was
    not sent) and FAILED otherwise (it was sent and no verdict came back). A verdict keyed by a
    turn index that is not among `turns` is a bookkeeping bug and raises ValueError.
    """
    indexes = [turn.index for turn in turns]
    if len(set(indexes)) != len(indexes):
        raise ValueError(f"turn indexes repeat: {sorted(indexes)}")
    unknown = sorted(set(verdicts) - set(indexes))
    if unknown:
        raise ValueError(f"verdicts for turns that do not exist: {unknown}")
    scores = []
    for turn in sorted(turns, key=lambda t: t.index):
        verdict = verdicts.get(turn.index)
        if verdict is not None:
            scores.append(step_score_of(turn.index, verdict))
        elif turn.format_error:
            scores.append(StepScore(turn.index, StepState.NOT_JUDGED))
        else:
            scores.append(StepScore(turn.index, StepState.FAILED))
    return scores


def mean_score(scores: Sequence[StepScore]) -> float | None:
    """Mean of the usable step scores; None when there is none."""
    usable = [s.score for s in scores if s.usable]
    return sum(usable) / len(usable) if usable else None


def combine_reward(outcome: float, scores: Sequence[StepScore], coef: float) -> float:
    """`outcome + coef * mean(usable step scores)`; the outcome alone when none is usable."""
    mean = mean_score(scores)
    return outcome if mean is None else outcome + coef * mean


def step_scores_with_outcome(scores: Sequence[StepScore], outcome: float) -> list[float]:
    """Per turn, `step score + outcome` (the seeds' step-wise reward); outcome when unusable."""
    return [outcome + s.score if s.usable else outcome for s in scores]


def turn_rewards(outcome: float, scores: Sequence[StepScore], coef: float) -> list[float]:
    """Per turn, `outcome + coef * step score` (TokenRecord.reward); outcome when unusable."""
    return [outcome + coef * s.score if s.usable else outcome for s in scores]
