"""Grading an episode's work: the evaluation of its patch and the outcome reward.

The patch is graded in a sandbox of its own, leased after the agent's sandbox was released
(nothing the agent left behind can touch the tests). A patch that changes nothing needs no
sandbox: the exec's own verdict (`swerl.exec.verdicts`) is given here without one. The outcome
reward is agent.proto's `EpisodeResult.reward`: +1 RESOLVED_FULL, -1 any other verdict, -1 a
sandbox the policy broke, none where nothing was graded.
"""

from __future__ import annotations

import time

from swerl.agent import budget
from swerl.agent.errors import EpisodeInfraError
from swerl.agent.loop.sandbox import SandboxProvider, guarded
from swerl.agent.spec import EpisodeSpec
from swerl.agent.status import EpisodeStatus
from swerl.chassis.bounded import within
from swerl.exec.v1 import evaluate_pb2
from swerl.exec.verdicts import empty_patch


async def evaluate(
    provider: SandboxProvider, spec: EpisodeSpec, key: str, patch: bytes, timeout_s: float
) -> evaluate_pb2.EvaluationReport:
    """The report on `patch` (`key` names the grading lease: the episode, or its branch) within
    `timeout_s` for its tests (the episode's eval_timeout, or what a harness episode's budget has
    left)."""
    verdict = empty_patch(patch)
    if verdict is not None:
        return verdict.report(spec.instance.instance_id)
    async with provider.lease(
        spec.instance.image_name,
        owner=spec.lease_owner,
        instance_id=spec.instance.instance_id,
        request_id=f"{key}-eval",
        workdir=None,
        avoid_node_ids=spec.avoid_node_ids,
    ) as grader:
        return await guarded(grader, grader.evaluate(spec.instance, patch, timeout_s))


async def evaluate_in_budget(
    provider: SandboxProvider,
    spec: EpisodeSpec,
    key: str,
    patch: bytes,
    budget_started: float | None,
) -> evaluate_pb2.EvaluationReport:
    """`evaluate` for an episode. A harness episode (its one budget started at `budget_started`,
    its lease) grades with what is left of that budget (swerl.agent.budget) and must end within
    it plus the grading's overhead: else INFRA_ERROR GRADING_OVER_BUDGET. swerl's own loop
    (`budget_started` None) grades within its eval_timeout."""
    limit_s, bound_s = spec.eval_timeout_s, None
    if budget_started is not None:
        left_s = spec.wall_timeout_s - (time.monotonic() - budget_started)
        limit_s = budget.grading_limit_s(left_s, spec.eval_timeout_s)
        bound_s = max(left_s, limit_s) + budget.GRADING_OVERHEAD_S
    try:
        return await within(evaluate(provider, spec, key, patch, limit_s), bound_s)
    except TimeoutError as err:
        if bound_s is None:
            raise
        raise EpisodeInfraError(
            "GRADING_OVER_BUDGET",
            f"the grading did not end within the episode's budget ({spec.wall_timeout_s:g} s"
            f" from its lease, plus {budget.GRADING_OVERHEAD_S:g} s for the grading itself)",
        ) from err


# Reasons an evaluation's report gives for a fault of its node (its sandbox or dockerd): the
# episode ends INFRA_ERROR with the node's own reason, as it does when a command hits one.
NODE_FAULTS = frozenset(
    {
        "DOCKER_UNAVAILABLE",
        "SANDBOX_STOPPED",
        "SANDBOX_NOT_RUNNING",
        "SANDBOX_CONTAINER_REMOVED",
        "SHELL_UNAVAILABLE",
    }
)


def check_report(report: evaluate_pb2.EvaluationReport) -> None:
    """An evaluation whose own infrastructure failed is no verdict: INFRA_ERROR, with the node's
    reason for a node fault, EVALUATION_INFRA_ERROR for anything else (e.g. a dataset's test
    patch that does not apply)."""
    if report.status == evaluate_pb2.EVALUATION_STATUS_INFRA_ERROR:
        reason = report.error_reason
        if reason not in NODE_FAULTS:
            reason = "EVALUATION_INFRA_ERROR"
        raise EpisodeInfraError(reason, f"{report.error_reason}: {report.error_message}")


def outcome_reward(
    status: EpisodeStatus | None, report: evaluate_pb2.EvaluationReport | None
) -> float | None:
    """The episode's outcome reward, or None when there is no verdict."""
    if status is EpisodeStatus.SANDBOX_BROKEN:
        return -1.0  # a failed attempt: the policy broke what it was to fix
    if status is None or not status.graded or report is None:
        return None
    return 1.0 if report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL else -1.0
