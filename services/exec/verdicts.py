"""Verdicts that need no sandbox, made in one place.

Evaluate gives them while it grades; the agent asks here before it leases a grading sandbox,
so an episode that changed nothing is graded without one and gets the very verdict Evaluate
would have given. Pure domain: no gRPC (the report built here is the contract's message).
"""

from __future__ import annotations

from dataclasses import dataclass

from swerl.exec.v1 import evaluate_pb2


@dataclass(frozen=True)
class Verdict:
    """An evaluation ended before any test ran."""

    status: str  # an EvaluationStatus name without its prefix ("UNRESOLVED")
    reason: str  # the report's error_reason
    message: str  # the report's error_message
    phase: str  # the phase it ended in (an EvaluationPhase name without its prefix)

    def report(self, instance_id: str) -> evaluate_pb2.EvaluationReport:
        """The whole report of this verdict: nothing applied, no test run."""
        return evaluate_pb2.EvaluationReport(
            instance_id=instance_id,
            status=f"EVALUATION_STATUS_{self.status}",
            apply_method=evaluate_pb2.APPLY_METHOD_NONE,
            test_exit_code=-1,
            error_reason=self.reason,
            error_message=self.message,
            failed_phase=f"EVALUATION_PHASE_{self.phase}",
        )


EMPTY_PATCH = Verdict(
    status="UNRESOLVED",
    reason="EMPTY_PATCH",
    message="the patch is empty: nothing to evaluate",
    phase="APPLY_PATCH",
)


def empty_patch(patch: bytes) -> Verdict | None:
    """EMPTY_PATCH for a patch that changes nothing (empty or whitespace only), else None."""
    return EMPTY_PATCH if not patch.strip() else None
