"""PRM step judging as the episode sees it: the turn it hands a judge, the score it gets back,
and the rewards made from those scores. Pure domain: no gRPC, no protos.

The episode judges each executed turn in the background while it goes on, so scores come back
out of order; each is keyed by its turn index and never lands on another turn. A format-error
turn ran nothing and is never sent (NOT_JUDGED); a judgment that raised or timed out is FAILED.

Rewards, as in the seeds' PRM recipe: the whole-trajectory reward is
`outcome + coef * mean(usable step scores)` (`trajectory_reward`) and a turn's reward is
`outcome + coef * its step score` (`turn_reward`); a turn without a usable score adds nothing
and takes no part in the mean.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class StepScoreState(enum.Enum):
    """What became of one turn's PRM judgment."""

    SCORED = "scored"
    NO_VALID_VOTES = "no_valid_votes"  # the judge answered, but no vote held a verdict
    FAILED = "failed"  # the judgment raised, timed out or could not reach the PRM service
    NOT_JUDGED = "not_judged"  # a format-error turn: nothing ran, nothing was sent


@dataclass(frozen=True)
class StepScore:
    turn_index: int
    state: StepScoreState
    score: float = 0.0
    valid_votes: int = 0

    @property
    def usable(self) -> bool:
        return self.state is StepScoreState.SCORED


@dataclass(frozen=True)
class TurnToJudge:
    """One executed turn of an episode, as a judge gets it."""

    turn_index: int
    issue: str
    response: str
    action: str
    exit_code: int
    output: str


# How long one turn's judgment may take when the episode's PRM options set no timeout.
PRM_STEP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PrmSpec:
    """An episode's PRM settings (EpisodeOptions.prm): whether and where its turns are judged,
    the votes per turn, the weight of the scores in the rewards, the judgment's seed and limit."""

    enabled: bool = False
    endpoint: str = ""
    m: int = 0
    coef: float = 0.0
    seed: int = 0
    timeout_s: float = PRM_STEP_TIMEOUT_S


class StepJudge(Protocol):
    """Judges the executed turns of one episode (one instance per episode, turns in order)."""

    async def judge(self, turn: TurnToJudge) -> StepScore: ...


def trajectory_reward(outcome: float, scores: Iterable[StepScore], coef: float) -> float:
    """`outcome + coef * mean(usable step scores)`; the outcome alone when none is usable."""
    usable = [s.score for s in scores if s.usable]
    return outcome + coef * (sum(usable) / len(usable)) if usable else outcome


def turn_reward(outcome: float, score: StepScore | None, coef: float) -> float:
    """`outcome + coef * step score`; the outcome alone when the turn has no usable score."""
    return outcome + coef * score.score if score is not None and score.usable else outcome
