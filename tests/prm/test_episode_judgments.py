"""The agent-side seam: an episode's turns judged in the background through the real client,
service and scripted judge, with every score on its own turn despite format errors."""

from __future__ import annotations

import asyncio

import pytest
from prm_testkit import ISSUE

from swerl.prm.episode import EpisodeJudgments
from swerl.prm.prompt import StepToJudge
from swerl.prm.scoring import StepState, combine_reward, step_scores_with_outcome
from swerl.prm.scripted import HANG, Reply, Rule, verdict
from swerl.prm.votes import JudgeState, Verdict

FORMAT_ERROR_TURNS = (2, 4)


def rules() -> list[Rule]:
    # The marker sits in the response, which only the judged step shows (history shows actions).
    return [
        Rule("MARK-T0", [verdict(1, delay_s=0.3)]),  # finishes last of the scored ones
        Rule("MARK-T1", [verdict(-1, delay_s=0.15)]),
        Rule("MARK-T3", [verdict(1), verdict(-1), verdict(1)]),
        Rule("MARK-T5", [Reply(text="no verdict here")]),
        Rule("MARK-T6", [HANG]),
    ]


async def play_episode(judgments: EpisodeJudgments) -> None:
    for turn in range(7):
        if turn in FORMAT_ERROR_TURNS:
            judgments.record_turn(
                turn, response="I will run two commands at once", format_error=True
            )
        else:
            judgments.record_turn(
                turn,
                response=f"MARK-T{turn}: next.\n```bash\nls step{turn}\n```",
                action=f"ls step{turn}",
                exit_code=turn,
                output=f"output of turn {turn}",
            )
        await asyncio.sleep(0)  # the episode goes on while judgments run


async def test_format_errors_in_turns_2_and_4_leave_every_score_on_its_own_turn(scripted, prm):
    judge = await scripted(rules=rules())
    running = await prm(judge.url, request_timeout_s=0.5)
    seen = []
    judgments = EpisodeJudgments(
        running.client, episode_id="ep-7", issue=ISSUE, votes=3, seed=1, on_score=seen.append
    )

    await play_episode(judgments)
    assert judgments.pending == 5  # recording a turn does not wait for its judgment

    scores = await judgments.finish()

    assert [(s.turn_index, s.state) for s in scores] == [
        (0, StepState.SCORED),
        (1, StepState.SCORED),
        (2, StepState.NOT_JUDGED),
        (3, StepState.SCORED),
        (4, StepState.NOT_JUDGED),
        (5, StepState.NO_VALID_VOTES),
        (6, StepState.FAILED),
    ]
    assert [s.score for s in scores] == pytest.approx([1.0, -1.0, 0.0, 1 / 3, 0.0, 0.0, 0.0])
    assert [s.valid_votes for s in scores] == [3, 3, 0, 3, 0, 0, 0]
    # Scores arrived out of turn order, each reported with its own turn index.
    assert sorted(s.turn_index for s in seen) == [0, 1, 3, 5, 6]
    assert [s.turn_index for s in seen] != [0, 1, 3, 5, 6]
    assert {s.turn_index: s for s in seen} == {
        s.turn_index: s for s in scores if s.turn_index in (0, 1, 3, 5, 6)
    }
    # Format-error turns were never sent to the judge; they show in later steps' history.
    assert not any("MARK-T2" in r.prompt_text or "MARK-T4" in r.prompt_text for r in judge.requests)
    turn3 = next(r.prompt_text for r in judge.requests if "MARK-T3" in r.prompt_text)
    assert "Step 2: (format error" in turn3
    assert "Step 1: $ ls step1" in turn3
    assert step_scores_with_outcome(scores, 1.0) == pytest.approx(
        [2.0, 0.0, 1.0, 4 / 3, 1.0, 1.0, 1.0]
    )
    assert combine_reward(1.0, scores, 0.5) == pytest.approx(1.0 + 0.5 * (1 - 1 + 1 / 3) / 3)


class RaisingJudge:
    async def judge_step(self, step: StepToJudge, **kwargs) -> Verdict:
        if step.step_index == 1:
            raise RuntimeError("judge exploded")
        return Verdict(JudgeState.SCORED, votes=(), score=float(step.step_index))


async def test_a_judge_that_raises_marks_only_its_turn_failed():
    judgments = EpisodeJudgments(RaisingJudge(), episode_id="ep", issue=ISSUE)
    for turn in range(3):
        judgments.record_turn(turn, response="r", action="ls")

    scores = await judgments.finish()

    assert [s.state for s in scores] == [StepState.SCORED, StepState.FAILED, StepState.SCORED]
    assert scores[2].score == 2.0


async def test_a_score_callback_that_fails_does_not_lose_the_score():
    def broken(score):
        raise RuntimeError("stream closed")

    judgments = EpisodeJudgments(RaisingJudge(), episode_id="ep", issue=ISSUE, on_score=broken)
    judgments.record_turn(0, response="r", action="ls")

    [score] = await judgments.finish()

    assert score.state is StepState.SCORED


class SlowJudge:
    async def judge_step(self, step: StepToJudge, **kwargs) -> Verdict:
        await asyncio.sleep(60)
        raise AssertionError("never reached")


async def test_cancelling_an_episode_abandons_its_running_judgments():
    judgments = EpisodeJudgments(SlowJudge(), episode_id="ep", issue=ISSUE)
    judgments.record_turn(0, response="r", action="ls")
    judgments.record_turn(1, response="r", format_error=True)

    await asyncio.wait_for(judgments.cancel(), 5)
    scores = await judgments.finish()

    assert [s.state for s in scores] == [StepState.FAILED, StepState.NOT_JUDGED]


async def test_recording_the_same_turn_twice_is_refused():
    judgments = EpisodeJudgments(RaisingJudge(), episode_id="ep", issue=ISSUE)
    judgments.record_turn(0, response="r", format_error=True)
    with pytest.raises(ValueError, match="already recorded"):
        judgments.record_turn(0, response="r", format_error=True)
