"""Shared pieces of the EvaluateService tests: the bundled tasks, instance dicts as protos,
one Evaluate call read to its end, and a running node with its stubs (EvalNode).

A plain module (not conftest) so tests import its helpers by name.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import grpc

from swerl.chassis.client import make_channel
from swerl.exec.server import ExecNode
from swerl.exec.v1 import evaluate_pb2 as pb
from swerl.exec.v1 import evaluate_pb2_grpc, sandbox_pb2_grpc
from swerl.tasks import load_tasks
from swerl.validate import instance_to_pb

TOKEN = "test-token"
# The bundled set itself, whatever SWERL_TASKS_DIR says.
BUNDLED_TASKS_DIR = Path(__file__).resolve().parents[2] / "examples" / "tasks"
BUNDLED_TASKS = load_tasks(BUNDLED_TASKS_DIR)
TASKS = {task.instance_id: task for task in BUNDLED_TASKS}
TASK_IDS = sorted(TASKS)
# Tasks whose tests need the network, kept apart so the bundled set stays offline-only.
NETWORK_TASKS_DIR = Path(__file__).resolve().parents[2] / "examples" / "network-tasks"
NETWORK_TASKS = {task.instance_id: task for task in load_tasks(NETWORK_TASKS_DIR)}
# Margin of the RPC deadline over the evaluation's own timeout.
RPC_MARGIN_S = 120.0

STATUS = {v: k.removeprefix("EVALUATION_STATUS_") for k, v in pb.EvaluationStatus.items()}
PHASE = {v: k.removeprefix("EVALUATION_PHASE_") for k, v in pb.EvaluationPhase.items()}
APPLY_METHOD = {v: k.removeprefix("APPLY_METHOD_") for k, v in pb.ApplyMethod.items()}


def task_instance(instance_id: str, **changes: Any) -> dict[str, Any]:
    """A copy of a bundled task's row with `changes` applied."""
    instance = dict(TASKS[instance_id].instance)
    instance.update(changes)
    return instance


@dataclass
class Evaluation:
    """Everything one Evaluate call streamed, in order."""

    responses: list[pb.EvaluateResponse] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return [str(r.WhichOneof("kind")) for r in self.responses]

    @property
    def phases(self) -> list[str]:
        return [PHASE[r.phase.phase] for r in self.responses if r.WhichOneof("kind") == "phase"]

    @property
    def logs(self) -> list[pb.EvaluationLog]:
        return [r.log for r in self.responses if r.WhichOneof("kind") == "log"]

    def log_of(self, phase: str) -> bytes:
        return b"".join(log.data for log in self.logs if PHASE[log.phase] == phase)

    @property
    def reports(self) -> list[pb.EvaluationReport]:
        return [r.report for r in self.responses if r.WhichOneof("kind") == "report"]

    @property
    def report(self) -> pb.EvaluationReport:
        assert len(self.reports) == 1, f"expected exactly one report, got {len(self.reports)}"
        assert self.kinds[-1] == "report", f"the report is not the last message: {self.kinds}"
        return self.reports[0]

    @property
    def status(self) -> str:
        return STATUS[self.report.status]

    @property
    def apply_method(self) -> str:
        return APPLY_METHOD[self.report.apply_method]


def evaluate_request(
    instance: dict[str, Any],
    patch: str | bytes,
    *,
    sandbox_id: str = "",
    timeout_s: float = 0.0,
    omit_logs: bool = False,
) -> pb.EvaluateRequest:
    request = pb.EvaluateRequest(
        request_id=uuid.uuid4().hex,
        sandbox_id=sandbox_id,
        instance=instance_to_pb(instance),
        patch=patch.encode() if isinstance(patch, str) else patch,
        omit_logs=omit_logs,
    )
    request.timeout.FromNanoseconds(int(timeout_s * 1e9))
    return request


async def evaluate(
    stub: evaluate_pb2_grpc.EvaluateServiceStub,
    instance: dict[str, Any],
    patch: str | bytes,
    **options: Any,
) -> Evaluation:
    """One Evaluate call read to its end (an RPC error propagates as AioRpcError)."""
    request = evaluate_request(instance, patch, **options)
    deadline = (options.get("timeout_s") or 600.0) + RPC_MARGIN_S
    evaluation = Evaluation()
    async for response in stub.Evaluate(request, timeout=deadline):
        evaluation.responses.append(response)
    return evaluation


async def evaluate_failure(
    stub: evaluate_pb2_grpc.EvaluateServiceStub,
    instance: dict[str, Any],
    patch: str | bytes,
    **options: Any,
) -> tuple[grpc.aio.AioRpcError, list[pb.EvaluateResponse]]:
    """An Evaluate call that must fail: its error and whatever it streamed before failing."""
    streamed: list[pb.EvaluateResponse] = []
    request = evaluate_request(instance, patch, **options)
    try:
        async for response in stub.Evaluate(request, timeout=RPC_MARGIN_S):
            streamed.append(response)
    except grpc.aio.AioRpcError as err:
        return err, streamed
    raise AssertionError(f"Evaluate succeeded, expected an error; streamed {streamed}")


class EvalNode:
    """A running exec node and stubs for both of its services on one authenticated channel."""

    def __init__(self, node: ExecNode) -> None:
        self.node = node
        self.manager = node.manager
        self.address = f"127.0.0.1:{node.port}"
        self.channel = make_channel(self.address, token=TOKEN)
        self.evaluate = evaluate_pb2_grpc.EvaluateServiceStub(self.channel)
        self.sandboxes = sandbox_pb2_grpc.SandboxServiceStub(self.channel)


def sweep_containers_of(node_id: str) -> list[str]:
    """Removes the node's sandbox containers left on dockerd and names them."""
    client = docker.from_env()
    try:
        found = client.containers.list(all=True, filters={"label": f"swerl.node={node_id}"})
        names = [container.name for container in found]
        for container in found:
            container.remove(force=True)
        return names
    finally:
        client.close()
