"""PrmService: protos in, a judge call, protos out. No logic, logging or settings here."""

from __future__ import annotations

from swerl.chassis.timeconv import duration_pb
from swerl.prm.judge import Judge
from swerl.prm.prompt import CurrentStep, HistoryStep, StepToJudge
from swerl.prm.v1 import prm_pb2 as pb
from swerl.prm.v1 import prm_pb2_grpc
from swerl.prm.votes import JudgeState, Verdict

# The domain's judge states and the contract's, value for value (a test checks both sides).
STATE_TO_PB: dict[JudgeState, pb.JudgeState] = {
    JudgeState.SCORED: pb.JUDGE_STATE_SCORED,
    JudgeState.NO_VALID_VOTES: pb.JUDGE_STATE_NO_VALID_VOTES,
    JudgeState.FAILED: pb.JUDGE_STATE_FAILED,
}


def step_from_pb(request: pb.JudgeStepRequest) -> StepToJudge:
    return StepToJudge(
        episode_id=request.episode_id,
        step_index=request.step_index,
        issue=request.issue,
        history=tuple(
            HistoryStep(
                action=h.action,
                exit_code=h.exit_code,
                output_head=h.output_head,
                output_tail=h.output_tail,
                format_error=h.format_error,
            )
            for h in request.history
        ),
        step=CurrentStep(
            response=request.step.response,
            action=request.step.action,
            exit_code=request.step.exit_code,
            output=request.step.output,
        ),
    )


def verdict_to_pb(verdict: Verdict) -> pb.JudgeStepResponse:
    return pb.JudgeStepResponse(
        score=verdict.score,
        votes=[
            pb.Vote(text=v.text, value=v.value, valid=v.valid, seed=v.seed, error_message=v.error)
            for v in verdict.votes
        ],
        valid_votes=verdict.valid_votes,
        state=STATE_TO_PB[verdict.state],
        error_message=verdict.error_message,
        judge_model=verdict.judge_model,
        judge_duration=duration_pb(verdict.duration_s),
    )


class PrmServicer(prm_pb2_grpc.PrmServiceServicer):
    def __init__(self, judge: Judge) -> None:
        self._judge = judge

    async def JudgeStep(self, request: pb.JudgeStepRequest, context) -> pb.JudgeStepResponse:
        verdict = await self._judge.judge(step_from_pb(request), votes=request.m, seed=request.seed)
        return verdict_to_pb(verdict)
