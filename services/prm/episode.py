"""PRM judging alongside an agent episode: the seam the Agent's episode loop calls.

The loop reports every turn as it finishes (`record_turn`); an executed turn is judged in the
background at once, with the turns before it as history, while the episode goes on. At the end
`finish()` waits for the judgments still running and returns one `StepScore` per turn, keyed
by turn index: format-error turns are NOT_JUDGED, a judgment that failed or timed out is
FAILED, and no score ever lands on another turn. `on_score` sees each score as it arrives (for
the RunEpisode `prm_score` messages). The judge is anything with `judge_step` (a `PrmClient`),
so this module needs no gRPC.

    judgments = EpisodeJudgments(prm_client, episode_id=..., issue=problem, votes=m, seed=seed)
    judgments.record_turn(i, response=text, action=cmd, exit_code=rc, output=out)
    judgments.record_turn(j, response=text, format_error=True)
    scores = await judgments.finish()
    reward = combine_reward(outcome, scores, coef)
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from swerl.prm.prompt import CurrentStep, HistoryStep, StepToJudge
from swerl.prm.scoring import StepScore, TurnRef, attach_step_scores, step_score_of
from swerl.prm.votes import JudgeState, Verdict

# The client keeps this much of each end of an earlier turn's output; the service cuts further.
HISTORY_OUTPUT_END_CHARS = 2000
_CANCELLED = Verdict(JudgeState.FAILED, votes=(), error_message="judgment cancelled")
_log = structlog.get_logger("swerl.prm")


class StepJudge(Protocol):
    async def judge_step(
        self, step: StepToJudge, *, votes: int = 0, seed: int = 0, timeout_s: float | None = None
    ) -> Verdict: ...


ScoreCallback = Callable[[StepScore], Awaitable[None] | None]


class EpisodeJudgments:
    """The PRM judgments of one episode's turns, running concurrently with the episode."""

    def __init__(
        self,
        judge: StepJudge,
        *,
        episode_id: str,
        issue: str,
        votes: int = 0,
        seed: int = 0,
        timeout_s: float | None = None,
        on_score: ScoreCallback | None = None,
    ) -> None:
        self._judge = judge
        self._episode_id = episode_id
        self._issue = issue
        self._votes = votes
        self._seed = seed
        self._timeout_s = timeout_s
        self._on_score = on_score
        self._turns: list[TurnRef] = []
        self._history: list[HistoryStep] = []
        self._tasks: dict[int, asyncio.Task[Verdict]] = {}

    def record_turn(
        self,
        turn_index: int,
        *,
        response: str,
        action: str = "",
        exit_code: int = 0,
        output: str = "",
        format_error: bool = False,
    ) -> None:
        """Adds a finished turn; an executed one starts being judged now, in the background."""
        if any(turn.index == turn_index for turn in self._turns):
            raise ValueError(f"turn {turn_index} was already recorded")
        self._turns.append(TurnRef(turn_index, format_error))
        if not format_error:
            step = StepToJudge(
                episode_id=self._episode_id,
                step_index=turn_index,
                issue=self._issue,
                history=tuple(self._history),
                step=CurrentStep(response, action, exit_code, output),
            )
            self._tasks[turn_index] = asyncio.get_running_loop().create_task(
                self._judge_one(turn_index, step)
            )
        head, tail = _ends(output)
        self._history.append(HistoryStep(action, exit_code, head, tail, format_error))

    async def _judge_one(self, turn_index: int, step: StepToJudge) -> Verdict:
        try:
            verdict = await self._judge.judge_step(
                step, votes=self._votes, seed=self._seed, timeout_s=self._timeout_s
            )
        except Exception as exc:  # A judge that raises must not end the episode.
            verdict = Verdict(JudgeState.FAILED, votes=(), error_message=repr(exc))
        if self._on_score is not None:
            try:
                outcome = self._on_score(step_score_of(turn_index, verdict))
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception:  # The verdict still counts when reporting it failed.
                _log.exception("prm.on_score_failed", turn_index=turn_index)
        return verdict

    @property
    def pending(self) -> int:
        return sum(1 for task in self._tasks.values() if not task.done())

    async def finish(self) -> list[StepScore]:
        """Waits for the judgments still running; one StepScore per recorded turn, in order."""
        if self._tasks:
            await asyncio.wait(self._tasks.values())
        verdicts = {
            index: _CANCELLED if task.cancelled() else task.result()
            for index, task in self._tasks.items()
        }
        return attach_step_scores(self._turns, verdicts)

    async def cancel(self) -> None:
        """Abandons the judgments still running (the episode was cancelled)."""
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


def _ends(output: str) -> tuple[str, str]:
    """Head and tail of an output for the history; all of it in the head when it is short."""
    if len(output) <= 2 * HISTORY_OUTPUT_END_CHARS:
        return output, ""
    return output[:HISTORY_OUTPUT_END_CHARS], output[-HISTORY_OUTPUT_END_CHARS:]
