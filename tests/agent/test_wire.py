"""The agent's enum tables cover both sides: a value renamed or added on either side fails here."""

from __future__ import annotations

from typing import Any

from swerl.agent.judging.steps import StepScore, StepScoreState
from swerl.agent.status import EpisodeStatus
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.wire import (
    EPISODE_STATUS_PB,
    STEP_SCORE_STATE_PB,
    episode_status_pb,
    step_score_pb,
)


def _specified(enum: Any) -> set[int]:
    return {v.number for v in enum.DESCRIPTOR.values if v.number != 0}


def test_every_episode_status_has_exactly_one_wire_value():
    assert set(EPISODE_STATUS_PB) == set(EpisodeStatus)
    assert sorted(EPISODE_STATUS_PB.values()) == sorted(_specified(pb.EpisodeStatus))


def test_every_step_score_state_has_exactly_one_wire_value():
    assert set(STEP_SCORE_STATE_PB) == set(StepScoreState)
    assert sorted(STEP_SCORE_STATE_PB.values()) == sorted(_specified(pb.StepScoreState))


def test_the_tables_pair_values_of_the_same_name():
    for status, number in EPISODE_STATUS_PB.items():
        assert pb.EpisodeStatus.Name(number) == "EPISODE_STATUS_" + status.name
    for state, number in STEP_SCORE_STATE_PB.items():
        assert pb.StepScoreState.Name(number) == "STEP_SCORE_STATE_" + state.name


def test_an_episode_without_a_status_yet_is_unspecified_on_the_wire():
    assert episode_status_pb(None) == pb.EPISODE_STATUS_UNSPECIFIED


def test_a_step_score_keeps_its_turn_score_and_votes_on_the_wire():
    message = step_score_pb(StepScore(5, StepScoreState.SCORED, -0.5, 3))
    assert message == pb.StepScore(
        turn_index=5, score=-0.5, valid_votes=3, state=pb.STEP_SCORE_STATE_SCORED
    )
