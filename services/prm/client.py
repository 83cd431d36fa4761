"""The async client the Agent calls once per step: always a verdict, never an exception.

`PrmClient.judge_step` sends a JudgeStep and returns the domain `Verdict`. Whatever goes wrong
on the way (the PRM service is down, the call runs past its limit, the request was refused) ends
as a FAILED verdict naming the cause, so the episode goes on and the step is marked failed. The
call is idempotent (same seeds, no side effects), so UNAVAILABLE is retried with the chassis
policy within the call's time limit.
"""

from __future__ import annotations

import time

import grpc

from swerl.chassis.client import error_info
from swerl.chassis.retry import async_retrying
from swerl.prm.prompt import StepToJudge
from swerl.prm.v1 import prm_pb2 as pb
from swerl.prm.v1 import prm_pb2_grpc
from swerl.prm.votes import JudgeState, Verdict, Vote

_STATE_FROM_PB = {
    pb.JUDGE_STATE_SCORED: JudgeState.SCORED,
    pb.JUDGE_STATE_NO_VALID_VOTES: JudgeState.NO_VALID_VOTES,
    pb.JUDGE_STATE_FAILED: JudgeState.FAILED,
}
DEFAULT_TIMEOUT_S = 300.0


def judge_request(step: StepToJudge, *, votes: int = 0, seed: int = 0) -> pb.JudgeStepRequest:
    current = step.step
    return pb.JudgeStepRequest(
        episode_id=step.episode_id,
        step_index=step.step_index,
        issue=step.issue,
        history=[
            pb.HistoryStep(
                action=h.action,
                format_error=h.format_error,
                exit_code=h.exit_code,
                output_head=h.output_head,
                output_tail=h.output_tail,
            )
            for h in step.history
        ],
        step=pb.CurrentStep(
            response=current.response,
            action=current.action,
            exit_code=current.exit_code,
            output=current.output,
        ),
        m=votes,
        seed=seed,
    )


def verdict_from_pb(response: pb.JudgeStepResponse) -> Verdict:
    return Verdict(
        state=_STATE_FROM_PB.get(response.state, JudgeState.FAILED),
        votes=tuple(
            Vote(seed=v.seed, text=v.text, value=v.value if v.valid else 0, error=v.error_message)
            for v in response.votes
        ),
        score=response.score,
        error_message=response.error_message,
        judge_model=response.judge_model,
        duration_s=response.judge_duration.seconds + response.judge_duration.nanos / 1e9,
    )


def failed_verdict(message: str, duration_s: float = 0.0) -> Verdict:
    return Verdict(JudgeState.FAILED, votes=(), error_message=message, duration_s=duration_s)


class PrmClient:
    """JudgeStep calls over `channel` (from `swerl.chassis.client.make_channel`)."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.stub = prm_pb2_grpc.PrmServiceStub(channel)
        self.timeout_s = timeout_s

    async def judge_step(
        self,
        step: StepToJudge,
        *,
        votes: int = 0,
        seed: int = 0,
        timeout_s: float | None = None,
    ) -> Verdict:
        """The verdict on `step`; FAILED (with the cause) when the call does not succeed.

        `timeout_s` bounds the whole call, retries included (default: the client's).
        """
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        request = judge_request(step, votes=votes, seed=seed)
        started = time.monotonic()
        deadline = started + limit_s
        last_failure = ""
        try:
            async for attempt in async_retrying(max_delay_s=limit_s):
                with attempt:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        message = f"JudgeStep ran past its {limit_s:g} s limit; {last_failure}"
                        return failed_verdict(message, limit_s)
                    try:
                        response = await self.stub.JudgeStep(request, timeout=remaining)
                    except grpc.RpcError as err:
                        last_failure = _describe(err)
                        raise
                    return verdict_from_pb(response)
        except grpc.RpcError as err:
            return failed_verdict(_describe(err), time.monotonic() - started)
        raise AssertionError("unreachable: the retry policy re-raises the last failure")


def _describe(err: grpc.RpcError) -> str:
    code = err.code().name if hasattr(err, "code") else "UNKNOWN"
    details = err.details() if hasattr(err, "details") else ""
    reason, _ = error_info(err)
    return f"JudgeStep failed: {code}{f'/{reason}' if reason else ''}: {details}"
