"""The agent's domain values as `swerl.agent.v1` protos: one explicit table per enum.

A table, not name arithmetic, so that renaming a value on either side fails the table test
(tests/agent/test_wire.py) instead of an episode at run time.
"""

from __future__ import annotations

from swerl.agent.judging.steps import StepScore, StepScoreState
from swerl.agent.status import EpisodeStatus
from swerl.agent.v1 import agent_pb2 as pb

EPISODE_STATUS_PB: dict[EpisodeStatus, pb.EpisodeStatus] = {
    EpisodeStatus.SUBMITTED: pb.EPISODE_STATUS_SUBMITTED,
    EpisodeStatus.LIMIT_TURNS: pb.EPISODE_STATUS_LIMIT_TURNS,
    EpisodeStatus.LIMIT_CONTEXT: pb.EPISODE_STATUS_LIMIT_CONTEXT,
    EpisodeStatus.LIMIT_TIME: pb.EPISODE_STATUS_LIMIT_TIME,
    EpisodeStatus.CANCELLED: pb.EPISODE_STATUS_CANCELLED,
    EpisodeStatus.ABORTED: pb.EPISODE_STATUS_ABORTED,
    EpisodeStatus.INFRA_ERROR: pb.EPISODE_STATUS_INFRA_ERROR,
    EpisodeStatus.SANDBOX_BROKEN: pb.EPISODE_STATUS_SANDBOX_BROKEN,
    EpisodeStatus.HARNESS_FAILED: pb.EPISODE_STATUS_HARNESS_FAILED,
    EpisodeStatus.HARNESS_TIMEOUT: pb.EPISODE_STATUS_HARNESS_TIMEOUT,
}

STEP_SCORE_STATE_PB: dict[StepScoreState, pb.StepScoreState] = {
    StepScoreState.SCORED: pb.STEP_SCORE_STATE_SCORED,
    StepScoreState.NO_VALID_VOTES: pb.STEP_SCORE_STATE_NO_VALID_VOTES,
    StepScoreState.FAILED: pb.STEP_SCORE_STATE_FAILED,
    StepScoreState.NOT_JUDGED: pb.STEP_SCORE_STATE_NOT_JUDGED,
}


def episode_status_pb(status: EpisodeStatus | None) -> pb.EpisodeStatus:
    """The wire status; UNSPECIFIED while the episode has none yet."""
    return pb.EPISODE_STATUS_UNSPECIFIED if status is None else EPISODE_STATUS_PB[status]


def step_score_pb(score: StepScore) -> pb.StepScore:
    return pb.StepScore(
        turn_index=score.turn_index,
        score=score.score,
        valid_votes=score.valid_votes,
        state=STEP_SCORE_STATE_PB[score.state],
    )
