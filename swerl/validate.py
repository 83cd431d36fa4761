"""`swerl validate`: proves a task set grades correctly before anyone trains on it.

Every instance's gold patch, an empty patch and (where the task has one) its known-wrong patch
go through the real EvaluateService in fresh sandboxes. The gold patch must resolve, the others
must not; anything else is a broken task (wrong FAIL_TO_PASS lists, an image at the wrong
commit, a flaky test) and makes the command exit non-zero. By default an exec node runs
in-process on the local dockerd; `--node` points at a running one instead.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from swerl.exec.v1 import evaluate_pb2 as pb
from swerl.exec.v1 import evaluate_pb2_grpc
from swerl.sweinstance import instance_to_pb
from swerl.tasks import TaskInstance

_STATUS = {v: k.removeprefix("EVALUATION_STATUS_") for k, v in pb.EvaluationStatus.items()}


@dataclass(frozen=True)
class Check:
    instance_id: str
    kind: str  # gold | empty | wrong
    status: str
    ok: bool
    detail: str
    seconds: float


async def evaluate_once(
    stub: evaluate_pb2_grpc.EvaluateServiceStub, instance: dict, patch: str, timeout_s: float
) -> pb.EvaluationReport:
    request = pb.EvaluateRequest(
        request_id=uuid.uuid4().hex,
        instance=instance_to_pb(instance),
        patch=patch.encode(),
        omit_logs=True,
    )
    request.timeout.FromNanoseconds(int(timeout_s * 1e9))
    report = None
    async for response in stub.Evaluate(request, timeout=timeout_s + 300):
        if response.WhichOneof("kind") == "report":
            report = response.report
    if report is None:
        raise RuntimeError("Evaluate ended without a report")
    return report


def _judge(task: TaskInstance, kind: str, report: pb.EvaluationReport) -> tuple[bool, str]:
    status = _STATUS[report.status]
    failed = list(report.fail_to_pass.failure) + list(report.pass_to_pass.failure)
    if kind == "gold":
        ok = status == "RESOLVED_FULL"
        detail = "" if ok else (report.error_reason or f"failing: {', '.join(failed[:4])}")
    elif kind == "wrong":
        broken = set(report.pass_to_pass.failure)
        expected = set(task.wrong_patch_breaks)
        ok = status not in ("RESOLVED_FULL", "RESOLVED_PARTIAL") and expected <= broken
        detail = f"breaks {', '.join(sorted(broken)) or 'nothing'}"
    else:
        ok = status not in ("RESOLVED_FULL", "RESOLVED_PARTIAL", "INFRA_ERROR")
        detail = report.error_reason
    if status == "INFRA_ERROR":
        detail = f"{report.error_reason}: {report.error_message[:120]}"
    return ok, detail


async def validate(
    tasks: Sequence[TaskInstance],
    stub: evaluate_pb2_grpc.EvaluateServiceStub,
    *,
    concurrency: int = 2,
    timeout_s: float = 600.0,
    progress=print,
) -> list[Check]:
    limit = asyncio.Semaphore(max(concurrency, 1))
    jobs = []
    for task in tasks:
        jobs.append((task, "gold", task.gold_patch))
        jobs.append((task, "empty", ""))
        if task.wrong_patch:
            jobs.append((task, "wrong", task.wrong_patch))
    done = 0

    async def one(task: TaskInstance, kind: str, patch: str) -> Check:
        nonlocal done
        async with limit:
            started = time.monotonic()
            try:
                report = await evaluate_once(stub, dict(task.instance), patch, timeout_s)
                status = _STATUS[report.status]
                ok, detail = _judge(task, kind, report)
            except grpc.aio.AioRpcError as exc:
                status, ok, detail = exc.code().name, False, exc.details() or ""
            done += 1
            check = Check(task.instance_id, kind, status, ok, detail, time.monotonic() - started)
            progress(
                f"[{done}/{len(jobs)}] {task.instance_id} {kind}: {status}"
                + ("" if ok else "  <-- unexpected")
            )
            return check

    return list(await asyncio.gather(*(one(*job) for job in jobs)))


def render(checks: Sequence[Check]) -> str:
    width = max((len(c.instance_id) for c in checks), default=10)
    lines = [f"{'instance':<{width}}  {'patch':<5}  {'status':<16}  {'ok':<3}  {'s':>5}  detail"]
    for c in checks:
        lines.append(
            f"{c.instance_id:<{width}}  {c.kind:<5}  {c.status:<16}  {'yes' if c.ok else 'NO':<3}"
            f"  {c.seconds:5.1f}  {c.detail}"
        )
    gold = [c for c in checks if c.kind == "gold"]
    resolved = sum(c.ok for c in gold)
    others = [c for c in checks if c.kind != "gold"]
    lines.append(
        f"\ngold resolved {resolved}/{len(gold)}; empty/wrong patches correctly not resolved"
        f" {sum(c.ok for c in others)}/{len(others)}"
    )
    return "\n".join(lines)


async def run_local(
    tasks: Sequence[TaskInstance],
    *,
    base_image: str,
    build: bool,
    concurrency: int,
    timeout_s: float,
) -> list[Check]:
    """Builds the task images (unless told not to) and validates on an in-process node."""
    from swerl.exec.server import local_node
    from swerl.tasks import build_images

    if build:
        await asyncio.to_thread(build_images, tasks, base_image=base_image)
    async with local_node("validate") as (_, channel):
        stub = evaluate_pb2_grpc.EvaluateServiceStub(channel)
        return await validate(tasks, stub, concurrency=concurrency, timeout_s=timeout_s)
