"""Step scores land on their own turns, and the rewards made from them (agent integration)."""

from __future__ import annotations

import pytest

from swerl.prm.scoring import (
    StepScore,
    StepState,
    TurnRef,
    attach_step_scores,
    combine_reward,
    mean_score,
    step_scores_with_outcome,
    turn_rewards,
)
from swerl.prm.votes import JudgeState, Verdict, Vote


def scored(score: float, valid: int = 1) -> Verdict:
    votes = tuple(Vote(seed=i, text="", value=1) for i in range(valid))
    return Verdict(JudgeState.SCORED, votes=votes, score=score)


NO_VOTES = Verdict(JudgeState.NO_VALID_VOTES, votes=(Vote(seed=1, text="hm", value=0),))
FAILED = Verdict(JudgeState.FAILED, votes=(), error_message="judge model timed out")


def test_format_errors_in_turns_2_and_4_leave_every_score_on_its_own_turn():
    turns = [TurnRef(i, format_error=i in (2, 4)) for i in range(7)]
    # Verdicts arrive in completion order, not turn order; format errors were never sent.
    verdicts = {5: scored(-1.0), 0: scored(1.0), 6: NO_VOTES, 3: scored(0.5, 2), 1: FAILED}

    scores = attach_step_scores(turns, verdicts)

    assert [s.turn_index for s in scores] == [0, 1, 2, 3, 4, 5, 6]
    assert [s.state for s in scores] == [
        StepState.SCORED,
        StepState.FAILED,
        StepState.NOT_JUDGED,
        StepState.SCORED,
        StepState.NOT_JUDGED,
        StepState.SCORED,
        StepState.NO_VALID_VOTES,
    ]
    assert [s.score for s in scores] == [1.0, 0.0, 0.0, 0.5, 0.0, -1.0, 0.0]
    assert scores[3].valid_votes == 2


def test_a_format_error_turn_that_was_judged_keeps_its_verdict():
    scores = attach_step_scores([TurnRef(0), TurnRef(1, format_error=True)], {1: scored(-1.0)})

    assert scores[1] == StepScore(1, StepState.SCORED, -1.0, 1)
    assert scores[0].state is StepState.FAILED  # sent, never answered


def test_a_verdict_for_a_turn_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=r"\[3\]"):
        attach_step_scores([TurnRef(0), TurnRef(1)], {3: scored(1.0)})


def test_repeated_turn_indexes_are_refused():
    with pytest.raises(ValueError, match="repeat"):
        attach_step_scores([TurnRef(0), TurnRef(0)], {})


def test_turns_are_ordered_by_index_whatever_order_they_come_in():
    scores = attach_step_scores([TurnRef(2), TurnRef(0), TurnRef(1)], {2: scored(1.0)})
    assert [s.turn_index for s in scores] == [0, 1, 2]
    assert scores[2].score == 1.0


def _scores() -> list[StepScore]:
    return [
        StepScore(0, StepState.SCORED, 1.0, 3),
        StepScore(1, StepState.NOT_JUDGED),
        StepScore(2, StepState.SCORED, -0.5, 2),
        StepScore(3, StepState.FAILED),
        StepScore(4, StepState.NO_VALID_VOTES),
    ]


def test_combined_reward_is_outcome_plus_coef_times_mean_of_usable_scores():
    assert mean_score(_scores()) == pytest.approx(0.25)
    assert combine_reward(1.0, _scores(), 0.5) == pytest.approx(1.125)
    assert combine_reward(-1.0, _scores(), 2.0) == pytest.approx(-0.5)


def test_combined_reward_without_usable_scores_is_the_outcome():
    unusable = [StepScore(0, StepState.FAILED), StepScore(1, StepState.NOT_JUDGED)]
    assert mean_score(unusable) is None
    assert combine_reward(-1.0, unusable, 1.0) == -1.0


def test_step_scores_with_outcome_add_the_outcome_to_each_usable_score():
    assert step_scores_with_outcome(_scores(), 1.0) == [2.0, 1.0, 0.5, 1.0, 1.0]


def test_turn_rewards_weight_each_usable_score():
    assert turn_rewards(-1.0, _scores(), 0.5) == [-0.5, -1.0, -1.25, -1.0, -1.0]


def test_every_step_state_names_a_state_of_the_agent_contract():
    from swerl.agent.v1 import agent_pb2

    # The agent maps StepScore.state by name: "STEP_SCORE_STATE_" + state.value.
    for state in StepState:
        assert agent_pb2.StepScoreState.Value(f"STEP_SCORE_STATE_{state.value}") > 0
