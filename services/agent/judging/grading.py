"""Grading an episode's work: the evaluation of its patch and the outcome reward.

The patch is graded in a sandbox of its own, leased after the agent's sandbox was released
(nothing the agent left behind can touch the tests). A patch that changes nothing needs no
sandbox: the exec's own verdict (`swerl.exec.verdicts`) is given here without one. The outcome
reward is agent.proto's `EpisodeResult.reward`: +1 RESOLVED_FULL, -1 any other verdict, -1 a
sandbox the policy broke, none where nothing was graded.
"""

from __future__ import annotations

from swerl.agent.errors import EpisodeInfraError
from swerl.agent.loop.sandbox import SandboxProvider, guarded
from swerl.agent.spec import EpisodeSpec
from swerl.agent.status import EpisodeStatus
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
