"""Evaluate overhead benchmark: what grading a patch costs beyond running the tests.

    python benchmarks/eval_bench.py [--repeats N] [--json OUT]

Starts `swerl exec serve` as a separate process (port 0, temp state dir, random token), builds
the bundled task images (examples/tasks, or $SWERL_TASKS_DIR) where they are missing, and then,
for every task with its gold patch and over N repeats, measures in one run:

  (a) cold: Evaluate with no sandbox_id. The node creates a sandbox from the instance image,
      evaluates and destroys it. Overhead = total - tests: container start, shell start, patch
      and test patch apply, grading and the removal of the container.
  (b) warm: a sandbox made beforehand with CreateSandbox (what a warm pool hands out; that
      create is timed but not counted), then Evaluate with its sandbox_id. Overhead = total -
      tests: shell start, patch and test patch apply, grading. No container start.
  (c) baselines from the same run: a plain `docker create` + `start` of the same image through
      the Docker SDK (removal timed apart), and the test run itself (tests_s of the reports).

Durations are the node's own (the report's total/apply/tests/grade); the client's wall time of
each Evaluate call is recorded too. Every evaluation must come back RESOLVED_FULL, since a gold
patch that does not resolve would time a different code path; one that does not is flagged.
It prints a p50 table per task and summary lines, and reports; it does not assert: the exit
status is 0 whatever the figures (1 when the run itself fails, 130 when interrupted). Every
sandbox and container it made is removed on the way out, Ctrl-C and errors included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import docker
import grpc
from benchkit import (
    Node,
    machine_facts,
    progress,
    raise_interrupt,
    run_main,
    shutdown_node,
    start_node,
    wait_serving,
)

from swerl.exec.v1 import evaluate_pb2, evaluate_pb2_grpc, sandbox_pb2, sandbox_pb2_grpc
from swerl.tasks import TaskInstance, build_images, default_tasks_dir, load_tasks
from swerl.validate import instance_to_pb

DEFAULT_BASE_IMAGE = os.environ.get("SWERL_BASE_IMAGE", "swerl-base:bookworm")
REPO_DIR = "/testbed"
TARGET_WARM_OVERHEAD_MS = 400.0

EVALUATE_TIMEOUT_S = 600.0
# Every RPC has a deadline; Evaluate's is its own timeout plus room for create and cleanup.
EVALUATE_DEADLINE_S = EVALUATE_TIMEOUT_S + 120.0
CREATE_DEADLINE_S = 120.0
DESTROY_DEADLINE_S = 60.0
# Marks the baseline containers, so a sweep at exit finds any a Ctrl-C left behind.
BASELINE_LABEL = "swerl.eval_bench"

_STATUS = {
    v: k.removeprefix("EVALUATION_STATUS_") for k, v in evaluate_pb2.EvaluationStatus.items()
}


def ms(seconds: float) -> float:
    return seconds * 1e3


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------------------------------------
# Samples


@dataclass
class EvalSample:
    """One Evaluate call: the node's report durations and the client's wall time, in seconds."""

    status: str
    total_s: float
    apply_s: float
    tests_s: float
    grade_s: float
    client_s: float
    # When each phase started, in seconds after PREPARE started (the node's phase messages).
    phase_start_s: dict[str, float] = field(default_factory=dict)
    error: str = ""
    # Warm only: the CreateSandbox call made before the evaluation (not part of its overhead).
    create_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.tests_s

    def _between(self, first: str, then: str) -> float:
        if first not in self.phase_start_s or then not in self.phase_start_s:
            return float("nan")
        return self.phase_start_s[then] - self.phase_start_s[first]

    @property
    def sandbox_s(self) -> float:
        """PREPARE: the sandbox create when the node makes one (plus the I/O dir, ~0)."""
        return self._between("PREPARE", "APPLY_PATCH")

    @property
    def test_patch_s(self) -> float:
        return self._between("APPLY_TEST_PATCH", "RUN_TESTS")

    @property
    def cleanup_s(self) -> float:
        """From the end of grading to the end of the evaluation: removing the container when
        the node made it (the report comes only after that)."""
        grade_start = self.phase_start_s.get("GRADE", float("nan"))
        return self.total_s - grade_start - self.grade_s

    @property
    def ok(self) -> bool:
        return self.status == "RESOLVED_FULL"


@dataclass
class DockerSample:
    create_s: float
    start_s: float
    remove_s: float

    @property
    def create_start_s(self) -> float:
        return self.create_s + self.start_s


@dataclass
class TaskFigures:
    instance_id: str
    image: str
    cold: list[EvalSample] = field(default_factory=list)
    warm: list[EvalSample] = field(default_factory=list)
    docker: list[DockerSample] = field(default_factory=list)

    def p50(self, kind: str, attr: str) -> float:
        return median([getattr(s, attr) for s in getattr(self, kind)])


# ---------------------------------------------------------------------------------------------
# Calls to the node


class Calls:
    """The node's stubs over one aio channel, and the warm sandboxes not yet destroyed."""

    def __init__(self, node: Node, channel: grpc.aio.Channel) -> None:
        self.node = node
        self.sandboxes = sandbox_pb2_grpc.SandboxServiceStub(channel)
        self.evaluations = evaluate_pb2_grpc.EvaluateServiceStub(channel)
        self.live_sandboxes: set[str] = set()

    async def create_sandbox(self, task: TaskInstance) -> tuple[str, float]:
        request = sandbox_pb2.CreateSandboxRequest(
            request_id="evalbench-create-" + secrets.token_hex(8),
            image=task.image_name,
            workdir=REPO_DIR,
            owner="eval_bench",
            instance_id=task.instance_id,
        )
        started = time.perf_counter()
        reply = await self.sandboxes.CreateSandbox(
            request, metadata=self.node.metadata, timeout=CREATE_DEADLINE_S
        )
        elapsed = time.perf_counter() - started
        self.live_sandboxes.add(reply.sandbox.sandbox_id)
        return reply.sandbox.sandbox_id, elapsed

    async def destroy_sandbox(self, sandbox_id: str) -> None:
        await self.sandboxes.DestroySandbox(
            sandbox_pb2.DestroySandboxRequest(
                request_id="evalbench-destroy-" + sandbox_id, sandbox_id=sandbox_id
            ),
            metadata=self.node.metadata,
            timeout=DESTROY_DEADLINE_S,
        )
        self.live_sandboxes.discard(sandbox_id)

    async def evaluate(self, task: TaskInstance, sandbox_id: str = "") -> EvalSample:
        request = evaluate_pb2.EvaluateRequest(
            request_id="evalbench-eval-" + secrets.token_hex(8),
            sandbox_id=sandbox_id,
            instance=instance_to_pb(dict(task.instance)),
            patch=task.gold_patch.encode(),
            omit_logs=True,
        )
        request.timeout.FromNanoseconds(int(EVALUATE_TIMEOUT_S * 1e9))
        report = None
        phases: dict[str, float] = {}
        started = time.perf_counter()
        async for response in self.evaluations.Evaluate(
            request, metadata=self.node.metadata, timeout=EVALUATE_DEADLINE_S
        ):
            kind = response.WhichOneof("kind")
            if kind == "phase":
                name = evaluate_pb2.EvaluationPhase.Name(response.phase.phase)
                phases[name.removeprefix("EVALUATION_PHASE_")] = (
                    response.phase.start_time.ToNanoseconds() / 1e9
                )
            elif kind == "report":
                report = response.report
        client_s = time.perf_counter() - started
        if report is None:
            raise RuntimeError(f"{task.instance_id}: Evaluate ended without a report")
        return EvalSample(
            status=_STATUS[report.status],
            total_s=report.total_duration.ToNanoseconds() / 1e9,
            apply_s=report.apply_duration.ToNanoseconds() / 1e9,
            tests_s=report.tests_duration.ToNanoseconds() / 1e9,
            grade_s=report.grade_duration.ToNanoseconds() / 1e9,
            client_s=client_s,
            phase_start_s={k: v - phases.get("PREPARE", v) for k, v in phases.items()},
            error=f"{report.error_reason} {report.error_message[:200]}".strip(),
        )


async def destroy_all(node: Node, sandbox_ids: Sequence[str]) -> int:
    """Destroys sandboxes through the node; returns how many could not be destroyed."""
    failed = 0
    async with grpc.aio.insecure_channel(node.address) as channel:
        calls = Calls(node, channel)
        for sandbox_id in sandbox_ids:
            try:
                await calls.destroy_sandbox(sandbox_id)
            except grpc.aio.AioRpcError as err:
                progress(f"  destroy {sandbox_id} failed: {err.code().name} {err.details()}")
                failed += 1
    return failed


# ---------------------------------------------------------------------------------------------
# (c) the docker create + start baseline


def docker_create_start(
    docker_client: docker.DockerClient, image: str, run_label: str
) -> DockerSample:
    """A plain `docker create` + `start` of `image` (what any sandbox costs at least), then its
    removal, each timed. One that a failure or Ctrl-C leaves behind carries BASELINE_LABEL,
    which the cleanup sweeps."""
    started = time.perf_counter()
    container = docker_client.containers.create(
        image,
        command=["sleep", "infinity"],
        network_mode="none",
        labels={BASELINE_LABEL: run_label},
        detach=True,
    )
    created = time.perf_counter()
    container.start()
    running = time.perf_counter()
    container.remove(force=True)
    removed = time.perf_counter()
    return DockerSample(created - started, running - created, removed - running)


# ---------------------------------------------------------------------------------------------
# The measurements


async def warm_sample(calls: Calls, task: TaskInstance) -> EvalSample:
    sandbox_id, create_s = await calls.create_sandbox(task)
    try:
        sample = await calls.evaluate(task, sandbox_id)
    finally:
        # Shielded: a Ctrl-C during the evaluation still removes the sandbox right here.
        await asyncio.shield(calls.destroy_sandbox(sandbox_id))
    sample.create_s = create_s
    return sample


def describe(sample: EvalSample) -> str:
    text = (
        f"total {ms(sample.total_s):7.0f} ms, tests {ms(sample.tests_s):6.0f} ms,"
        f" overhead {ms(sample.overhead_s):6.0f} ms  {sample.status}"
    )
    return text if sample.ok else f"{text}  <-- not resolved: {sample.error}"


async def measure(
    node: Node,
    docker_client: docker.DockerClient,
    tasks: Sequence[TaskInstance],
    args: argparse.Namespace,
    live_sandboxes: set[str],
    run_label: str,
) -> list[TaskFigures]:
    figures = [TaskFigures(t.instance_id, t.image_name) for t in tasks]
    async with grpc.aio.insecure_channel(node.address) as channel:
        calls = Calls(node, channel)
        # The cleanup in main() sees the same set, so it can destroy what a Ctrl-C left.
        calls.live_sandboxes = live_sandboxes
        for number in range(args.warmup):
            # The node's first evaluation imports swebench and warms its caches; the first
            # create of an image warms dockerd's. Neither belongs in the figures.
            task = tasks[number % len(tasks)]
            progress(
                f"warm-up {number + 1}/{args.warmup}: cold + warm Evaluate of {task.instance_id}"
            )
            await calls.evaluate(task)
            await warm_sample(calls, task)
        for repeat in range(1, args.repeats + 1):
            for number, (task, out) in enumerate(zip(tasks, figures, strict=True), start=1):
                label = (
                    f"repeat {repeat}/{args.repeats}, task {number}/{len(tasks)} {task.instance_id}"
                )
                base = await asyncio.to_thread(
                    docker_create_start, docker_client, task.image_name, run_label
                )
                out.docker.append(base)
                progress(
                    f"{label}\n          docker create+start {ms(base.create_start_s):5.0f} ms"
                    f" (create {ms(base.create_s):.0f}, start {ms(base.start_s):.0f},"
                    f" remove {ms(base.remove_s):.0f})"
                )
                cold = await calls.evaluate(task)
                out.cold.append(cold)
                progress(f"  cold  {describe(cold)}")
                warm = await warm_sample(calls, task)
                out.warm.append(warm)
                progress(f"  warm  {describe(warm)}  (CreateSandbox {ms(warm.create_s):.0f} ms)")
    return figures


# ---------------------------------------------------------------------------------------------
# Report


def render_table(figures: Sequence[TaskFigures]) -> str:
    width = max(len(f.instance_id) for f in figures)
    header = (
        f"{'task':<{width}}  {'tests':>6}  {'cold':>6}  {'cold':>6}  {'warm':>6}  {'warm':>6}"
        f"  {'warm':>6}  {'warm':>6}  {'docker':>6}  {'cold ovh/':>9}  {'not':>3}"
    )
    header2 = (
        f"{'':<{width}}  {'':>6}  {'total':>6}  {'ovh':>6}  {'total':>6}  {'ovh':>6}"
        f"  {'apply':>6}  {'grade':>6}  {'c+s':>6}  {'docker':>9}  {'ok':>3}"
    )
    lines = [header, header2, "-" * len(header)]
    for f in figures:
        cold_ovh = f.p50("cold", "overhead_s")
        docker_cs = f.p50("docker", "create_start_s")
        failed = sum(not s.ok for s in f.cold + f.warm)
        lines.append(
            f"{f.instance_id:<{width}}"
            f"  {ms(median([s.tests_s for s in f.cold + f.warm])):6.0f}"
            f"  {ms(f.p50('cold', 'total_s')):6.0f}  {ms(cold_ovh):6.0f}"
            f"  {ms(f.p50('warm', 'total_s')):6.0f}  {ms(f.p50('warm', 'overhead_s')):6.0f}"
            f"  {ms(f.p50('warm', 'apply_s')):6.0f}  {ms(f.p50('warm', 'grade_s')):6.0f}"
            f"  {ms(docker_cs):6.0f}  {cold_ovh / docker_cs:8.1f}x  {failed:>3}"
        )
    return "\n".join(lines)


OVERHEAD_PARTS = ("sandbox", "apply", "test_patch", "grade", "cleanup")


def breakdown_ms(samples: Sequence[EvalSample]) -> dict[str, float]:
    """Medians of the parts of the overhead; `rest` is the median of what they leave over."""
    parts = {
        name: ms(median([getattr(s, f"{name}_s") for s in samples])) for name in OVERHEAD_PARTS
    }
    rest = [s.overhead_s - sum(getattr(s, f"{name}_s") for name in OVERHEAD_PARTS) for s in samples]
    return parts | {"rest": ms(median(rest))}


def summarize(figures: Sequence[TaskFigures]) -> dict[str, Any]:
    """Medians over every sample of every task (tasks x repeats)."""
    cold = [s for f in figures for s in f.cold]
    warm = [s for f in figures for s in f.warm]
    docker_runs = [s for f in figures for s in f.docker]
    cold_ovh = median([s.overhead_s for s in cold])
    warm_ovh = median([s.overhead_s for s in warm])
    docker_cs = median([s.create_start_s for s in docker_runs])
    return {
        "samples_per_kind": len(cold),
        "not_resolved": sum(not s.ok for s in cold + warm),
        "tests_ms": ms(median([s.tests_s for s in cold + warm])),
        "cold_total_ms": ms(median([s.total_s for s in cold])),
        "cold_overhead_ms": ms(cold_ovh),
        "cold_overhead_parts_ms": breakdown_ms(cold),
        "warm_total_ms": ms(median([s.total_s for s in warm])),
        "warm_overhead_ms": ms(warm_ovh),
        "warm_overhead_parts_ms": breakdown_ms(warm),
        "warm_client_minus_total_ms": ms(median([s.client_s - s.total_s for s in warm])),
        "warm_create_sandbox_ms": ms(median([s.create_s for s in warm])),
        "docker_create_start_ms": ms(docker_cs),
        "docker_create_ms": ms(median([s.create_s for s in docker_runs])),
        "docker_start_ms": ms(median([s.start_s for s in docker_runs])),
        "docker_remove_ms": ms(median([s.remove_s for s in docker_runs])),
        "cold_overhead_over_docker": cold_ovh / docker_cs,
        "cold_minus_warm_overhead_ms": ms(cold_ovh - warm_ovh),
        "warm_target_ms": TARGET_WARM_OVERHEAD_MS,
        "warm_target_pass": ms(warm_ovh) <= TARGET_WARM_OVERHEAD_MS,
    }


def sample_json(sample: EvalSample) -> dict[str, Any]:
    derived = ("overhead", *OVERHEAD_PARTS)
    return asdict(sample) | {f"{name}_s": getattr(sample, f"{name}_s") for name in derived}


def print_summary(summary: dict[str, Any]) -> None:
    s = summary
    n = s["samples_per_kind"]

    def parts(kind: str) -> str:
        return ", ".join(f"{k} {v:.0f}" for k, v in s[f"{kind}_overhead_parts_ms"].items())

    print(f"\nsummary (medians over {n} samples per kind, all tasks x repeats):")
    print(f"  tests (the bare test run, tests_s)        {s['tests_ms']:8.0f} ms")
    print(
        f"  overhead cold  (total - tests)            {s['cold_overhead_ms']:8.0f} ms"
        f"   (total {s['cold_total_ms']:.0f} ms)"
    )
    print(f"      of which, medians in ms: {parts('cold')}")
    print(
        f"  overhead warm  (total - tests)            {s['warm_overhead_ms']:8.0f} ms"
        f"   (total {s['warm_total_ms']:.0f} ms)"
    )
    print(f"      of which, medians in ms: {parts('warm')}")
    print(f"  cold - warm overhead                      {s['cold_minus_warm_overhead_ms']:8.0f} ms")
    print(
        f"  docker create+start baseline              {s['docker_create_start_ms']:8.0f} ms"
        f"   (create {s['docker_create_ms']:.0f}, start {s['docker_start_ms']:.0f};"
        f" remove, not in it: {s['docker_remove_ms']:.0f})"
    )
    print(
        f"  CreateSandbox before a warm evaluation    {s['warm_create_sandbox_ms']:8.0f} ms"
        "   (paid by the pool, not in warm overhead)"
    )
    print(
        f"  client wall - node total (warm)           {s['warm_client_minus_total_ms']:8.0f} ms"
        "   (gRPC and eval spec; in no figure above)"
    )
    print(f"  cold overhead / docker create+start       {s['cold_overhead_over_docker']:8.1f}x")
    if s["not_resolved"]:
        print(f"  WARNING: {s['not_resolved']} evaluations did not resolve (see progress lines)")
    verdict = "PASS" if s["warm_target_pass"] else "MISS"
    print(
        f"\ntarget:\n  {verdict}  warm overhead <= {s['warm_target_ms']:.0f} ms"
        f"   measured {s['warm_overhead_ms']:.0f} ms"
    )


# ---------------------------------------------------------------------------------------------
# The run


def benchmark(args: argparse.Namespace, workdir: Path, cleanup: list[Callable[[], None]]) -> dict:
    docker_client = docker.from_env()
    cleanup.append(docker_client.close)
    facts = machine_facts(docker_client)
    print("machine:", flush=True)
    for key, value in facts.items():
        print(f"  {key:<28} {value}", flush=True)

    tasks = load_tasks(args.tasks_dir)
    if args.task:
        unknown = set(args.task) - {t.instance_id for t in tasks}
        if unknown:
            raise SystemExit(f"unknown --task: {', '.join(sorted(unknown))}")
        tasks = [t for t in tasks if t.instance_id in set(args.task)]
    progress(f"{len(tasks)} tasks from {args.tasks_dir}; images (built where missing):")
    build_images(
        tasks,
        base_image=args.base_image,
        docker_client=docker_client,
        progress=lambda line: print(f"          {line}", flush=True),
    )

    run_label = secrets.token_hex(6)
    live_sandboxes: set[str] = set()
    node = start_node(workdir, "evalbench-")

    def stop_everything() -> None:
        if node.process.poll() is None and node.address and live_sandboxes:
            progress(f"destroying {len(live_sandboxes)} sandboxes through the node")
            failed = asyncio.run(destroy_all(node, sorted(live_sandboxes)))
            if failed:
                progress(f"  {failed} could not be destroyed through the node")
        shutdown_node(node, docker_client, [BASELINE_LABEL])

    cleanup.append(stop_everything)
    ready_s = wait_serving(node)
    progress(f"node SERVING on {node.address} after {ready_s:.2f} s")
    print(
        f"\nmeasuring {len(tasks)} tasks x {args.repeats} repeats (gold patches), after"
        f" {args.warmup} warm-up round(s); ms are the node's report durations",
        flush=True,
    )

    async def run() -> list[TaskFigures]:
        # SIGTERM (a CI timeout, `kill`) stops the run like Ctrl-C: cancelled, then cleaned up.
        main_task = asyncio.current_task()
        assert main_task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
        return await measure(node, docker_client, tasks, args, live_sandboxes, run_label)

    try:
        figures = asyncio.run(run())
    finally:
        # Closing the loop reset SIGTERM to the default (die at once); it must clean up instead.
        signal.signal(signal.SIGTERM, raise_interrupt)

    print(f"\nper task, p50 over {args.repeats} repeats, ms (ovh = total - tests):")
    print(render_table(figures), flush=True)
    summary = summarize(figures)
    facts["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(
        f"\nload average (1 min) at start {facts['loadavg_1m_at_start']}, at end"
        f" {facts['loadavg_1m_at_end']}: other work on the machine skews figures"
    )
    print_summary(summary)
    return {
        "machine": facts,
        "settings": {
            "repeats": args.repeats,
            "warmup": args.warmup,
            "base_image": args.base_image,
            "tasks_dir": str(args.tasks_dir),
            "node": "swerl exec serve, separate process",
        },
        "summary": summary,
        "tasks": [
            {
                "instance_id": f.instance_id,
                "image": f.image,
                "cold": [sample_json(s) for s in f.cold],
                "warm": [sample_json(s) for s in f.warm],
                "docker": [asdict(s) | {"create_start_s": s.create_start_s} for s in f.docker],
            }
            for f in figures
        ],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per task")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed cold + warm rounds before measuring"
    )
    parser.add_argument("--json", type=Path, help="also write every sample as JSON here")
    parser.add_argument(
        "--base-image", default=DEFAULT_BASE_IMAGE, help="BASE_IMAGE for task images it builds"
    )
    parser.add_argument("--tasks-dir", type=Path, default=default_tasks_dir())
    parser.add_argument(
        "--task", action="append", help="only this instance id (repeatable; default: all)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be positive and --warmup not negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(parse_args(argv), benchmark, "swerl-eval-bench-")


if __name__ == "__main__":
    sys.exit(main())
