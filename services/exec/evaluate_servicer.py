"""EvaluateService: protos in, the evaluator, protos out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from swerl.chassis.timeconv import duration_pb, seconds_of, timestamp_pb
from swerl.exec.capability import require_lease_token
from swerl.exec.evaluate import Evaluator, LogEvent, PhaseEvent, Report
from swerl.exec.servicer import NETWORK_TO_PB, OUTPUT_STREAM_TO_PB
from swerl.exec.sweinstance import instance_from_pb
from swerl.exec.v1 import evaluate_pb2 as pb
from swerl.exec.v1 import evaluate_pb2_grpc

# Domain values <-> contract enums, spelled out so a rename on either side fails at import
# (and in tests/evaluate/test_evaluate_enum_tables.py), not in the middle of an evaluation.
STATUS_TO_PB: Mapping[str, pb.EvaluationStatus] = {
    "RESOLVED_FULL": pb.EVALUATION_STATUS_RESOLVED_FULL,
    "RESOLVED_PARTIAL": pb.EVALUATION_STATUS_RESOLVED_PARTIAL,
    "UNRESOLVED": pb.EVALUATION_STATUS_UNRESOLVED,
    "PATCH_FAILED": pb.EVALUATION_STATUS_PATCH_FAILED,
    "TIMEOUT": pb.EVALUATION_STATUS_TIMEOUT,
    "INFRA_ERROR": pb.EVALUATION_STATUS_INFRA_ERROR,
}
PHASE_TO_PB: Mapping[str, pb.EvaluationPhase] = {
    "PREPARE": pb.EVALUATION_PHASE_PREPARE,
    "APPLY_PATCH": pb.EVALUATION_PHASE_APPLY_PATCH,
    "APPLY_TEST_PATCH": pb.EVALUATION_PHASE_APPLY_TEST_PATCH,
    "RUN_TESTS": pb.EVALUATION_PHASE_RUN_TESTS,
    "GRADE": pb.EVALUATION_PHASE_GRADE,
}
APPLY_METHOD_TO_PB: Mapping[str, pb.ApplyMethod] = {
    "NONE": pb.APPLY_METHOD_NONE,
    "GIT_APPLY": pb.APPLY_METHOD_GIT_APPLY,
    "GIT_APPLY_3WAY": pb.APPLY_METHOD_GIT_APPLY_3WAY,
    "GIT_APPLY_REJECT": pb.APPLY_METHOD_GIT_APPLY_REJECT,
    "PATCH_FUZZ": pb.APPLY_METHOD_PATCH_FUZZ,
}


def report_to_pb(report: Report) -> pb.EvaluationReport:
    return pb.EvaluationReport(
        instance_id=report.instance_id,
        status=STATUS_TO_PB[report.status],
        patch_applied=report.patch_applied,
        apply_method=APPLY_METHOD_TO_PB[report.apply_method],
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
            PHASE_TO_PB[report.failed_phase]
            if report.failed_phase
            else pb.EVALUATION_PHASE_UNSPECIFIED
        ),
        network=NETWORK_TO_PB[report.network],
        package_index=report.package_index,
        warnings=[
            pb.EvaluationWarning(reason=w.reason, message=w.message) for w in report.warnings
        ],
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
                        phase=PHASE_TO_PB[event.phase],
                        stream=OUTPUT_STREAM_TO_PB[event.stream],
                        data=event.data,
                    )
                )
            elif isinstance(event, PhaseEvent):
                yield pb.EvaluateResponse(
                    phase=pb.EvaluationPhaseChange(
                        phase=PHASE_TO_PB[event.phase],
                        start_time=timestamp_pb(event.time),
                    )
                )
            elif isinstance(event, Report):
                yield pb.EvaluateResponse(report=report_to_pb(event))
