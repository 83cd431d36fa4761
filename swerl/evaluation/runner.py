"""Runs the selected instances as agent episodes, `concurrency` at a time, recording each result
as it ends, with a live progress line (done / resolved / errors / running / ETA).

Best-of-n (`branch_at`/`branches`): each instance is one branching episode
(EpisodeOptions.branch): the trunk runs `branch_at` turns once, then `branches` branches with
distinct sampling seeds go on from the same sandbox state and are graded one by one; the
instance gets one record per branch (`branch`, `sampling_seed`)."""

from __future__ import annotations

import asyncio
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc

from swerl.agent import budget
from swerl.agent import client as agent_client
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.v1 import agent_pb2_grpc
from swerl.chassis.bounded import within
from swerl.chassis.client import error_info
from swerl.evaluation.dataset import EvalInstance
from swerl.evaluation.results import ERROR_STATUSES, OutputDir, combine
from swerl.exec.v1 import evaluate_pb2

_EPISODE_STATUS = {v: k.removeprefix("EPISODE_STATUS_") for k, v in pb.EpisodeStatus.items()}
_EVAL_STATUS = {
    v: k.removeprefix("EVALUATION_STATUS_") for k, v in evaluate_pb2.EvaluationStatus.items()
}
# How long an interrupted episode gets to end itself (CANCELLED, sandbox released).
CANCEL_GRACE_S = 10.0
_POLICY_API = {
    "sglang": pb.POLICY_API_SGLANG_GENERATE,
    "vllm": pb.POLICY_API_VLLM_GENERATE,
    "openai": pb.POLICY_API_OPENAI_CHAT,
}


@dataclass
class EvalConfig:
    policy_endpoint: str
    policy_api: str = "sglang"
    model: str = ""
    tokenizer_path: str = ""
    sampling_params: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 0
    max_context_tokens: int = 0
    max_new_tokens: int = 0
    wall_timeout_s: float = 0.0
    command_timeout_s: float = 0.0
    eval_timeout_s: float = 0.0
    concurrency: int = 4
    artifact_dir: str = ""
    config_name: str = ""
    owner: str = "swerl-eval"
    # EpisodeOptions.harness: who drives each episode ("" = the agent's default, builtin).
    harness: str = ""
    # Best-of-n from a shared start: turns of the shared trunk, and branches (0: no branching).
    branch_at: int = 0
    branches: int = 0

    @property
    def episode_deadline_s(self) -> float:
        # The agent enforces the limits; this deadline only catches an agent that never answers.
        # It is past the agent's own bound on the episode, so no sandbox outlives its episode.
        return budget.client_deadline(
            wall_timeout_s=self.wall_timeout_s,
            eval_timeout_s=self.eval_timeout_s,
            harness=self.harness,
            config_name=self.config_name,
        ).deadline_s


def episode_start(instance: EvalInstance, config: EvalConfig, episode_id: str) -> pb.EpisodeStart:
    from swerl.exec.sweinstance import sample_instance

    swe = sample_instance({"instance": instance.instance, "data_source": instance.data_source})
    start = agent_client.episode_start(
        episode_id=episode_id,
        instance=swe,
        policy=pb.PolicyConfig(
            endpoint=config.policy_endpoint,
            api=_POLICY_API[config.policy_api],
            model=config.model,
            tokenizer_path=config.tokenizer_path,
        ),
        limits=agent_client.episode_limits(
            max_turns=config.max_turns,
            max_context_tokens=config.max_context_tokens,
            max_new_tokens=config.max_new_tokens,
            wall_timeout_s=config.wall_timeout_s,
            command_timeout_s=config.command_timeout_s,
            eval_timeout_s=config.eval_timeout_s,
        ),
        options=pb.EpisodeOptions(
            artifact_dir=config.artifact_dir,
            config_name=config.config_name,
            owner=config.owner,
            harness=config.harness,
        ),
        sampling_params=config.sampling_params,
    )
    if config.branches:
        start.options.branch.at_turn = config.branch_at
        start.options.branch.count = config.branches
    return start


async def run_episode(
    stub: agent_pb2_grpc.AgentServiceStub, instance: EvalInstance, config: EvalConfig
) -> list[dict[str, Any]]:
    """One episode to its result records: one, or with branching one per branch (in branch
    order). Failures of the call itself are an INFRA_ERROR record (after the branches' records
    that did arrive)."""
    safe_id = re.sub(r"[^A-Za-z0-9_.-]", "_", instance.instance_id)[:80]
    episode_id = f"eval-{safe_id}-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    record: dict[str, Any] = {"instance_id": instance.instance_id, "episode_id": episode_id}
    episode: agent_client.EpisodeCall | None = None
    try:
        start = episode_start(instance, config, episode_id)
        # The stream stays open after `start`, so that an interrupted run can still `cancel`.
        episode = await agent_client.open_episode(stub, start, timeout=config.episode_deadline_s)
        try:
            await episode.wait()
        except asyncio.CancelledError:
            await _cancel_episode(episode)
            raise
        finally:
            await episode.done_writing()
    except grpc.RpcError as exc:
        reason = error_info(exc)[0] or exc.code().name
        record.update(status="INFRA_ERROR", error_reason=reason, error_message=exc.details())
    except ValueError as exc:  # the instance could not be turned into a request
        record.update(status="INFRA_ERROR", error_reason="BAD_INSTANCE", error_message=str(exc))
    results = episode.results if episode is not None else []
    if "status" not in record and not results:
        record.update(status="INFRA_ERROR", error_reason="NO_RESULT", error_message="")
    records = []
    for result in sorted(results, key=lambda r: r.branch):
        branch_record = {**record, **_result_fields(result)}
        if config.branches:
            branch_record["branch"] = result.branch if result.HasField("branch") else None
            branch_record["sampling_seed"] = result.sampling_seed
        records.append(branch_record)
    if "status" in record or not records:  # the call failed (after any branch results)
        if config.branches:
            record.update(branch=None, sampling_seed=0)
        records.append(record)
    finished_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for one in records:
        one["resolved"] = bool(one.get("resolved"))
        one["duration_s"] = round(time.monotonic() - started, 3)
        one["finished_at"] = finished_at
    return records


async def _cancel_episode(episode: agent_client.EpisodeCall) -> None:
    """Asks the agent to stop the episode (it kills the command and releases the sandbox) and
    waits a little for its CANCELLED result; a dropped call is the agent's cue as well."""
    await episode.cancel("swerl eval stopped")
    try:
        await within(episode.wait(), CANCEL_GRACE_S)
    except (asyncio.TimeoutError, grpc.RpcError):
        episode.abort()


def _result_fields(result: pb.EpisodeResult) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "status": _EPISODE_STATUS.get(result.status, "UNSPECIFIED"),
        "reward": result.reward if result.HasField("reward") else None,
        "error_reason": result.error_reason,
        "error_message": result.error_message,
        "metrics": dict(result.metrics),
        "artifact_dir": result.artifact_dir,
        "patch": result.patch.decode("utf-8", "replace"),
        "eval_status": "",
    }
    if result.HasField("report"):
        report = result.report
        fields["eval_status"] = _EVAL_STATUS.get(report.status, "UNSPECIFIED")
        fields["resolved"] = report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
    return fields


class Progress:
    """The live line; on a terminal it rewrites itself, elsewhere it prints at each change."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.resolved = 0
        self.errors = 0
        self.running = 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()

    def finish(self, record: dict[str, Any]) -> None:
        """Counts one finished instance (its combined record, see results.combine)."""
        self.done += 1
        self.resolved += bool(record.get("resolved"))
        self.errors += record["status"] in ERROR_STATUSES
        self.show()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        if self.done:
            left = elapsed / self.done * (self.total - self.done)
            eta = f"{int(left // 60):02d}:{int(left % 60):02d}"
        else:
            eta = "--:--"
        width = 24
        filled = int(width * self.done / self.total) if self.total else width
        bar = "#" * filled + "." * (width - filled)
        return (
            f"[{bar}] {self.done}/{self.total} done | {self.resolved} resolved | "
            f"{self.errors} errors | {self.running} running | ETA {eta}"
        )

    def show(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line())
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


async def run_all(
    stub: agent_pb2_grpc.AgentServiceStub,
    instances: list[EvalInstance],
    out: OutputDir,
    config: EvalConfig,
    progress: Progress,
) -> None:
    """Runs every instance; cancelling this cancels the running episodes (the agent releases
    their sandboxes) and records nothing for them."""
    limit = asyncio.Semaphore(max(1, config.concurrency))

    async def one(instance: EvalInstance) -> None:
        async with limit:
            progress.running += 1
            progress.show()
            try:
                records = await run_episode(stub, instance, config)
            finally:
                progress.running -= 1
            out.append(*records)
            progress.finish(combine(records))

    tasks = [asyncio.ensure_future(one(instance)) for instance in instances]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
