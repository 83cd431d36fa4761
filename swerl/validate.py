"""`swerl validate`: proves a task set grades correctly before anyone trains on it.

Three checks per instance, each through the real EvaluateService in a fresh sandbox, as
SWE-bench validates its own tasks:

- unpatched: the tests on the tree as the image holds it, with the test patch applied and no
  fix. Every FAIL_TO_PASS test must fail there and every PASS_TO_PASS test must pass; a task
  that fails this is reported broken (wrong test lists, an image at the wrong commit), with the
  tests that disagree, whatever its gold patch does.
- gold: the reference fix must resolve.
- empty (and the known-wrong patch, where the task has one): must not resolve.

Anything unexpected makes the command exit non-zero. By default an exec node runs
in-process on the local dockerd; `--node` points at a running one instead.

Tasks come from a tasks directory or from a rows file of SWE-bench / SWE-Gym rows as published
(swerl.tasks.load_task_source). A row's image is the one published for it (its image_name, else
its dataset's naming rule) and is never built or pulled here: validation talks to one exec node,
not to a pool that places pulls, so an image the node lacks is refused up front in one line
naming the row and the image (`swerl images pull` or `docker pull` puts it there).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from swerl.exec.client import SandboxClient
from swerl.exec.settings import DEFAULT_EVALUATION_TIMEOUT_S
from swerl.exec.sweinstance import instance_to_pb
from swerl.exec.v1 import evaluate_pb2 as pb
from swerl.tasks import TaskInstance, images_missing

RESOLVED = (pb.EVALUATION_STATUS_RESOLVED_FULL, pb.EVALUATION_STATUS_RESOLVED_PARTIAL)


def _status_name(status: pb.EvaluationStatus) -> str:
    """For the table only; verdicts compare the enum values themselves."""
    return pb.EvaluationStatus.Name(status).removeprefix("EVALUATION_STATUS_")


@dataclass(frozen=True)
class Check:
    instance_id: str
    kind: str  # unpatched | gold | empty | wrong
    status: str
    ok: bool
    detail: str
    seconds: float


# Evaluate grades an empty patch without running the tests, so the unpatched check sends a patch
# that only adds this file outside the package: the tests run on the tree as it is.
UNPATCHED_MARKER_FILE = ".swerl-validate-unpatched"
UNPATCHED_PATCH = (
    f"diff --git a/{UNPATCHED_MARKER_FILE} b/{UNPATCHED_MARKER_FILE}\n"
    "new file mode 100644\n"
    "--- /dev/null\n"
    f"+++ b/{UNPATCHED_MARKER_FILE}\n"
    "@@ -0,0 +1 @@\n"
    "+the tests of swerl validate's unpatched check run on the tree as the image holds it\n"
)


async def evaluate_once(
    node: SandboxClient, instance: dict, patch: str, timeout_s: float
) -> pb.EvaluationReport:
    """One Evaluate in the node's own fresh sandbox, its tests bounded by `timeout_s`."""
    report = await node.evaluation_report(
        instance_to_pb(instance), patch.encode(), timeout_s=timeout_s
    )
    if report is None:
        raise RuntimeError("Evaluate ended without a report")
    return report


def _judge(task: TaskInstance, kind: str, report: pb.EvaluationReport) -> tuple[bool, str]:
    status = report.status
    failed = list(report.fail_to_pass.failure) + list(report.pass_to_pass.failure)
    if kind == "unpatched":
        passing = list(report.fail_to_pass.success)
        failing = list(report.pass_to_pass.failure)
        ok = (
            status in (pb.EVALUATION_STATUS_UNRESOLVED, pb.EVALUATION_STATUS_RESOLVED_PARTIAL)
            and not report.error_reason  # graded: the log had test results
            and not passing
            and not failing
        )
        parts = []
        if passing:
            parts.append(f"FAIL_TO_PASS passing unpatched: {', '.join(passing[:4])}")
        if failing:
            parts.append(f"PASS_TO_PASS failing unpatched: {', '.join(failing[:4])}")
        if status == pb.EVALUATION_STATUS_RESOLVED_FULL:
            parts.append("resolved without a fix")
        if not ok and not parts:
            parts.append(report.error_reason or _status_name(status))
        detail = "; ".join(parts) if not ok else ""
    elif kind == "gold":
        ok = status == pb.EVALUATION_STATUS_RESOLVED_FULL
        detail = "" if ok else (report.error_reason or f"failing: {', '.join(failed[:4])}")
    elif kind == "wrong":
        broken = set(report.pass_to_pass.failure)
        expected = set(task.wrong_patch_breaks)
        ok = status not in RESOLVED and expected <= broken
        detail = f"breaks {', '.join(sorted(broken)) or 'nothing'}"
    else:
        ok = status not in (*RESOLVED, pb.EVALUATION_STATUS_INFRA_ERROR)
        detail = report.error_reason
    if status == pb.EVALUATION_STATUS_INFRA_ERROR:
        detail = f"{report.error_reason}: {report.error_message[:120]}"
    if report.warnings and not ok:
        # A task that needs network, graded offline, reads differently from a broken one.
        flagged = "; ".join(f"{w.reason}: {w.message[:120]}" for w in report.warnings)
        detail = f"{detail} [{flagged}]".strip()
    return ok, detail


async def validate(
    tasks: Sequence[TaskInstance],
    node: SandboxClient,
    *,
    concurrency: int = 2,
    timeout_s: float = DEFAULT_EVALUATION_TIMEOUT_S,
    progress=print,
) -> list[Check]:
    limit = asyncio.Semaphore(max(concurrency, 1))
    jobs = []
    for task in tasks:
        jobs.append((task, "unpatched", UNPATCHED_PATCH))
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
                report = await evaluate_once(node, dict(task.instance), patch, timeout_s)
                status = _status_name(report.status)
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
    lines = [f"{'instance':<{width}}  {'check':<9}  {'status':<16}  {'ok':<3}  {'s':>5}  detail"]
    for c in checks:
        lines.append(
            f"{c.instance_id:<{width}}  {c.kind:<9}  {c.status:<16}  {'yes' if c.ok else 'NO':<3}"
            f"  {c.seconds:5.1f}  {c.detail}"
        )
    unpatched = [c for c in checks if c.kind == "unpatched"]
    gold = [c for c in checks if c.kind == "gold"]
    others = [c for c in checks if c.kind in ("empty", "wrong")]
    lines.append(
        f"\nunpatched tree as the task says {sum(c.ok for c in unpatched)}/{len(unpatched)};"
        f" gold resolved {sum(c.ok for c in gold)}/{len(gold)};"
        f" empty/wrong patches correctly not resolved {sum(c.ok for c in others)}/{len(others)}"
    )
    for c in unpatched:
        if not c.ok:
            lines.append(f"broken task {c.instance_id}: {c.detail}")
    return "\n".join(lines)


async def require_node_images(tasks: Sequence[TaskInstance], channel: grpc.aio.Channel) -> None:
    """Raises TaskImageError, in one line naming the first task's row and image, unless the node
    has every task's image (as its ListImages reports them)."""
    from swerl.images.pull import canonical_image

    listed = await SandboxClient(channel).list_images()
    present = {canonical_image(tag) for image in listed for tag in image.repo_tags}
    missing = [task for task in tasks if canonical_image(task.image_name) not in present]
    if missing:
        raise images_missing(missing, "the exec node")


async def run_remote(
    tasks: Sequence[TaskInstance],
    *,
    node: str,
    token: str | None,
    concurrency: int,
    timeout_s: float,
) -> list[Check]:
    """Validates on a running exec node, which must hold every task's image."""
    from swerl.chassis.client import make_channel

    channel = make_channel(node, token=token)
    try:
        await require_node_images(tasks, channel)
        client = SandboxClient(channel)
        return await validate(tasks, client, concurrency=concurrency, timeout_s=timeout_s)
    finally:
        await channel.close()


async def run_local(
    tasks: Sequence[TaskInstance],
    *,
    base_image: str,
    build: bool,
    concurrency: int,
    timeout_s: float,
) -> list[Check]:
    """Builds the task images that have a Dockerfile (unless told not to; published images
    are only checked for their base commit) and validates on an in-process node."""
    from swerl.exec.server import local_node
    from swerl.tasks import build_images, require_images

    if build:
        await asyncio.to_thread(build_images, tasks, base_image=base_image)
    else:
        await asyncio.to_thread(require_images, tasks)
    async with local_node("validate") as (_, channel):
        node = SandboxClient(channel)
        return await validate(tasks, node, concurrency=concurrency, timeout_s=timeout_s)
