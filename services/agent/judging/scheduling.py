"""PRM scheduling for one episode: each executed turn is judged in the background while the
loop goes on, each score is emitted as it lands, and the rewards fold the scores in.

A format-error turn is never sent (NOT_JUDGED at once); an episode without a judge scores its
turns FAILED. A branch shares its trunk's judgments instead of asking again: it waits for the
ones still pending (shielded, so one branch's end never cancels them for the others) and reads
the trunk's scores before its own when it builds its result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from swerl.agent.judging.steps import (
    PrmSpec,
    StepJudge,
    StepScore,
    StepScoreState,
    TurnToJudge,
    trajectory_reward,
    turn_reward,
)
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.wire import step_score_pb
from swerl.chassis.bounded import within


class StepScoring:
    """The PRM step scores of one episode (or branch), keyed by turn index."""

    def __init__(
        self,
        prm: PrmSpec,
        judge: StepJudge | None,
        issue: str,
        emit: Callable[[pb.RunEpisodeResponse], None],
    ) -> None:
        self._prm = prm
        self._judge = judge
        self._issue = issue
        self._emit = emit
        self.scores: dict[int, StepScore] = {}
        self._pending: list[asyncio.Task[None]] = []
        # A branch's view of its trunk: the trunk's judgments and the dict its scores land in.
        self._trunk_pending: list[asyncio.Task[None]] = []
        self._trunk_scores: dict[int, StepScore] = {}

    def for_branch(self, emit: Callable[[pb.RunEpisodeResponse], None]) -> StepScoring:
        """A branch's scoring: its own turns judged anew, the trunk's shared as they land."""
        branch = StepScoring(self._prm, self._judge, self._issue, emit)
        branch._trunk_pending = list(self._pending)
        branch._trunk_scores = self.scores
        return branch

    def judge_turn(
        self, index: int, response: str, action: str | None, exit_code: int, output: str
    ) -> None:
        """Schedules the judgment of turn `index` (`action` None: a format error, not sent)."""
        if not self._prm.enabled:
            return
        if action is None:
            self._score(StepScore(index, StepScoreState.NOT_JUDGED))
            return
        if self._judge is None:
            self._score(StepScore(index, StepScoreState.FAILED))
            return
        turn = TurnToJudge(
            turn_index=index,
            issue=self._issue,
            response=response,
            action=action,
            exit_code=exit_code,
            output=output,
        )
        self._pending.append(asyncio.ensure_future(self._judged(self._judge, turn)))

    async def settle(self) -> None:
        """Waits for every judgment still pending, the trunk's included (never raises)."""
        if self._pending or self._trunk_pending:
            # The trunk's judgments are shared by its branches: shielded from this one's end.
            shared = [asyncio.shield(task) for task in self._trunk_pending]
            await asyncio.gather(*shared, *self._pending, return_exceptions=True)

    def cancel(self) -> None:
        """Abandons this episode's own pending judgments (never the trunk's)."""
        for task in self._pending:
            task.cancel()

    def take_trunk_scores(self) -> None:
        """Puts the trunk's scores before this branch's own (a branch's result has both)."""
        if self._trunk_scores:
            self.scores = {**self._trunk_scores, **self.scores}

    def shaped(self, outcome: float | None, turn_index: int | None) -> float | None:
        """The reward of the whole trajectory (`turn_index` None) or of one turn: the outcome
        with the step scores folded in when the episode asked for them."""
        if outcome is None:
            return None
        prm = self._prm
        if not prm.enabled or not prm.coef:
            return outcome
        if turn_index is None:
            return trajectory_reward(outcome, self.scores.values(), prm.coef)
        return turn_reward(outcome, self.scores.get(turn_index), prm.coef)

    def fill(self, result: pb.EpisodeResult, branch: int | None, branch_at: int) -> None:
        """The result's step scores in turn order; a branch's own turns carry its index."""
        if not self._prm.enabled:
            return
        result.step_scores.extend(step_score_pb(self.scores[i]) for i in sorted(self.scores))
        if branch is not None:  # its own turns' scores, after the trunk's
            for score in result.step_scores:
                if score.turn_index >= branch_at:
                    score.branch = branch

    async def _judged(self, judge: StepJudge, turn: TurnToJudge) -> None:
        try:
            judged = await within(judge.judge(turn), self._prm.timeout_s)
        except Exception:  # a judge that fails costs its turn's score, never the episode
            judged = StepScore(turn.turn_index, StepScoreState.FAILED)
        # Keyed by the turn it was asked for, whatever the judge wrote: no score changes turns.
        self._score(StepScore(turn.turn_index, judged.state, judged.score, judged.valid_votes))

    def _score(self, score: StepScore) -> None:
        self.scores[score.turn_index] = score
        self._emit(pb.RunEpisodeResponse(prm_score=step_score_pb(score)))
