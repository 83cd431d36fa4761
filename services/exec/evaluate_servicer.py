"""EvaluateService: protos in, the evaluator, protos out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from swerl.chassis.timeconv import duration_pb, seconds_of, timestamp_pb
from swerl.exec.capability import require_lease_token
from swerl.exec.evaluate import Evaluator, LogEvent, PhaseEvent, Report
from swerl.exec.v1 import evaluate_pb2 as pb
from swerl.exec.v1 import evaluate_pb2_grpc


def instance_from_pb(message: pb.SweInstance) -> dict:
    """The SWE-bench column names the evaluator (and swebench) expect."""
    instance = dict(message.extra)
    instance.update(
        instance_id=message.instance_id,
        repo=message.repo,
        version=message.version,
        base_commit=message.base_commit,
        test_patch=message.test_patch,
        FAIL_TO_PASS=list(message.fail_to_pass),
        PASS_TO_PASS=list(message.pass_to_pass),
        eval_script=message.eval_script,
        log_parser=message.log_parser,
        eval_type=message.eval_type,
        image_name=message.image_name,
        problem_statement=message.problem_statement,
        hints_text=message.hints_text,
        environment_setup_commit=message.environment_setup_commit,
        created_at=message.created_at,
    )
    return instance


def report_to_pb(report: Report) -> pb.EvaluationReport:
    return pb.EvaluationReport(
        instance_id=report.instance_id,
        status=pb.EvaluationStatus.Value("EVALUATION_STATUS_" + report.status),
        patch_applied=report.patch_applied,
        apply_method=pb.ApplyMethod.Value("APPLY_METHOD_" + report.apply_method),
        fail_to_pass=pb.TestOutcomes(success=report.f2p_success, failure=report.f2p_failure),
        pass_to_pass=pb.TestOutcomes(success=report.p2p_success, failure=report.p2p_failure),
        test_exit_code=report.test_exit_code,
        total_duration=duration_pb(report.total_s),
        apply_duration=duration_pb(report.apply_s),
        tests_duration=duration_pb(report.tests_s),
        grade_duration=duration_pb(report.grade_s),
        error_reason=report.error_reason,
        error_message=report.error_message,
        failed_phase=(
            pb.EvaluationPhase.Value("EVALUATION_PHASE_" + report.failed_phase)
            if report.failed_phase
            else pb.EVALUATION_PHASE_UNSPECIFIED
        ),
    )


class EvaluateServicer(evaluate_pb2_grpc.EvaluateServiceServicer):
    def __init__(self, evaluator: Evaluator) -> None:
        self._evaluator = evaluator

    async def Evaluate(
        self, request: pb.EvaluateRequest, context
    ) -> AsyncIterator[pb.EvaluateResponse]:
        if request.sandbox_id:
            require_lease_token(self._evaluator.manager, context, request.sandbox_id)
        events = self._evaluator.evaluate(
            instance_from_pb(request.instance),
            request.patch,
            sandbox_id=request.sandbox_id,
            timeout_s=seconds_of(request.timeout),
            omit_logs=request.omit_logs,
        )
        async for event in events:
            if isinstance(event, LogEvent):
                yield pb.EvaluateResponse(
                    log=pb.EvaluationLog(
                        phase=pb.EvaluationPhase.Value("EVALUATION_PHASE_" + event.phase),
                        stream=event.stream,
                        data=event.data,
                    )
                )
            elif isinstance(event, PhaseEvent):
                yield pb.EvaluateResponse(
                    phase=pb.EvaluationPhaseChange(
                        phase=pb.EvaluationPhase.Value("EVALUATION_PHASE_" + event.phase),
                        start_time=timestamp_pb(event.time),
                    )
                )
            elif isinstance(event, Report):
                yield pb.EvaluateResponse(report=report_to_pb(event))
