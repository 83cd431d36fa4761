"""The rewards an episode makes from its PRM step scores, and how PRM verdicts become scores."""

from __future__ import annotations

import pytest

from swerl.agent.judging.prm_client import STEP_STATE_OF_JUDGE_STATE, step_score_of
from swerl.agent.judging.steps import StepScore, StepScoreState, trajectory_reward, turn_reward
from swerl.prm.votes import JudgeState, Verdict, Vote

S = StepScoreState


def _scores() -> list[StepScore]:
    return [
        StepScore(0, S.SCORED, 1.0, 3),
        StepScore(1, S.NOT_JUDGED),
        StepScore(2, S.SCORED, -0.5, 2),
        StepScore(3, S.FAILED),
        StepScore(4, S.NO_VALID_VOTES),
    ]


def test_trajectory_reward_is_outcome_plus_coef_times_mean_of_usable_scores():
    assert trajectory_reward(1.0, _scores(), 0.5) == pytest.approx(1.125)
    assert trajectory_reward(-1.0, _scores(), 2.0) == pytest.approx(-0.5)


def test_trajectory_reward_without_usable_scores_is_the_outcome():
    unusable = [StepScore(0, S.FAILED), StepScore(1, S.NOT_JUDGED), StepScore(2, S.NO_VALID_VOTES)]
    assert trajectory_reward(-1.0, unusable, 1.0) == -1.0
    assert trajectory_reward(1.0, [], 1.0) == 1.0


def test_turn_rewards_weight_each_usable_score_and_leave_the_rest_at_the_outcome():
    rewards = [turn_reward(-1.0, s, 0.5) for s in _scores()]
    assert rewards == [-0.5, -1.0, -1.25, -1.0, -1.0]
    assert turn_reward(1.0, None, 0.5) == 1.0  # a turn whose judgment never came back


def test_a_scored_verdict_keeps_its_score_and_valid_votes():
    votes = (Vote(seed=1, text="", value=1), Vote(seed=2, text="", value=-1))
    verdict = Verdict(JudgeState.SCORED, votes=votes, score=0.25)
    assert step_score_of(4, verdict) == StepScore(4, S.SCORED, 0.25, 2)


def test_unscored_verdicts_carry_no_score():
    invalid = Verdict(JudgeState.NO_VALID_VOTES, votes=(Vote(seed=1, text="hm", value=0),))
    failed = Verdict(JudgeState.FAILED, votes=(), score=0.7, error_message="judge timed out")
    assert step_score_of(2, invalid) == StepScore(2, S.NO_VALID_VOTES, 0.0, 0)
    assert step_score_of(3, failed) == StepScore(3, S.FAILED, 0.0, 0)


def test_every_judge_state_maps_to_a_step_score_state():
    assert set(STEP_STATE_OF_JUDGE_STATE) == set(JudgeState)
    assert StepScoreState.NOT_JUDGED not in STEP_STATE_OF_JUDGE_STATE.values()
