"""One episode: lease a sandbox, loop policy turn → command → observation, grade, reward.

`Episode.run()` emits `agent.v1` messages (started, turns, PRM scores, evaluation) through a
callback and returns the final message (`RunEpisodeResponse.result`). Everything that goes wrong
after the start ends in a result, never an exception: infrastructure failures are INFRA_ERROR
with no reward, `cancel()` ends the episode CANCELLED (the running policy call and command are
abandoned, the sandbox released), a policy abort ends it ABORTED.

Blame when a sandbox breaks: a command of the policy that kills its own shell or every process
of the sandbox is an ordinary turn (the observation says the command was killed by a signal;
the exec node starts the sandbox again and the next observation says so). A sandbox that cannot
be started again ends the episode SANDBOX_BROKEN (reward -1, the policy's doing) when the
policy's previous command ended killed by a signal, INFRA_ERROR otherwise. CPU work (rendering,
tokenizing, decoding, records) runs in the agent's thread pool or tokenizer processes so
hundreds of episodes share one event loop.

This module is the loop; the rooms beside it: `swerl.agent.actions` (the `ActionProtocol` the
episode picks at its start, bash blocks or tool calls, that acts on one reply in the sandbox),
`swerl.agent.harnesses.driving` (a harness's run and how it ended), `swerl.agent.loop.branching`
(fork, seeds, running the branches), `swerl.agent.judging.grading` (the evaluation and the
outcome reward), `swerl.agent.judging.scheduling` (PRM judgments in the background and the shaped
rewards), `swerl.agent.loop.records` (the token records of the result) and `swerl.agent.spec`
(what an episode runs with).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from swerl.agent import budget
from swerl.agent.actions.base import ActionProtocol, ActionTurn, SandboxBroken
from swerl.agent.actions.bash_block import BashBlockActions
from swerl.agent.actions.tool_set import killed_by
from swerl.agent.actions.tool_turn import ToolCallActions, ToolState
from swerl.agent.actions.toolcalls import CallIds
from swerl.agent.errors import EpisodeInfraError
from swerl.agent.gateway.service import Gateway
from swerl.agent.harnesses import DEFAULT_HARNESS, HarnessRun, driving, harness_named
from swerl.agent.harnesses.model import EpisodeModel
from swerl.agent.judging import grading
from swerl.agent.judging.scheduling import StepScoring
from swerl.agent.judging.steps import PrmSpec, StepJudge
from swerl.agent.loop import branching, records
from swerl.agent.loop.pacing import IterationGate
from swerl.agent.loop.sandbox import (
    ForkedSandbox,
    SandboxHandle,
    SandboxProvider,
    guarded,
    lease_lost,
)
from swerl.agent.policy.clients import PolicyUnavailable
from swerl.agent.policy.modes import ContextExhausted, Policy
from swerl.agent.spec import EpisodeSpec, sampling_params_of
from swerl.agent.status import EpisodeStatus
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.wire import episode_status_pb
from swerl.chassis.timeconv import duration_pb
from swerl.exec.v1 import evaluate_pb2

# The episode's inputs, importable from here as before the split.
__all__ = [
    "Clock",
    "Episode",
    "EpisodeDeps",
    "EpisodeSpec",
    "PrmSpec",
    "SandboxBroken",
    "killed_by",
    "sampling_params_of",
]

T = TypeVar("T")


@dataclass
class Clock:
    started: float = field(default_factory=time.monotonic)
    model_s: float = 0.0
    env_s: float = 0.0
    eval_s: float | None = None
    agent_s: float = 0.0


@dataclass(frozen=True)
class EpisodeDeps:
    """What every episode of one agent shares: sandboxes, the CPU pool and the pacing."""

    provider: SandboxProvider
    executor: Executor | None = None
    write_artifacts: Callable[[Episode, pb.EpisodeResult], Awaitable[str]] | None = None
    # Final results of ending episodes: at most so many per loop iteration.
    result_gate: IterationGate | None = None
    # Token records are built in the CPU pool one episode at a time.
    records_slot: asyncio.Semaphore | None = None
    # The model gateway a harness episode opens its session on (swerl.agent.harnesses.model).
    gateway: Callable[[], Awaitable[Gateway]] | None = None


class Episode:
    def __init__(
        self,
        spec: EpisodeSpec,
        *,
        policy: Policy,
        deps: EpisodeDeps,
        emit: Callable[[pb.RunEpisodeResponse], None],
        judge: StepJudge | None = None,
    ) -> None:
        self.spec = spec
        self._policy = policy
        self._deps = deps
        self._provider = deps.provider
        self._emit = emit
        self._scoring = StepScoring(spec.prm, judge, spec.instance.problem_statement, emit)
        self.clock = Clock()
        self.status: EpisodeStatus | None = None
        self.error_reason = ""
        self.error_message = ""
        self.messages: list[dict[str, Any]] = []
        # How a reply becomes actions in the sandbox: bash blocks, or tool calls (agent config
        # `tool_calls`); it keeps its own per-episode state (a branch gets a copy).
        call_ids = CallIds(seed=zlib.crc32(spec.episode_id.encode()))
        self.actions: ActionProtocol = (
            ToolCallActions(spec, self._cpu, ToolState(call_ids))
            if spec.config.tool_calls
            else BashBlockActions(spec, self._cpu)
        )
        self.steps: list[dict[str, Any]] = []
        self.turns = 0
        self.tool_calls = 0
        self.submission: str | None = None
        self.patch = b""
        self.report: evaluate_pb2.EvaluationReport | None = None
        self.reward: float | None = None
        self._work: asyncio.Task[None] | None = None
        self._cancel_reason: str | None = None
        # Branching (swerl.agent.loop.branching): a branch's index, seed and forked sandbox (None
        # for a trunk or a plain episode); a trunk's running branches and the last result.
        self.branch: int | None = None
        self.sampling_seed = 0
        self._forked: ForkedSandbox | None = None
        self._branches: list[Episode] = []
        self._last_branch_result: pb.RunEpisodeResponse | None = None
        # Who drives the episode in its sandbox (EpisodeOptions.harness; the runner checked it).
        self.harness = harness_named(spec.harness)
        # A harness episode's gateway session (None for swerl's own loop).
        self.model: EpisodeModel | None = None
        # When a harness episode's one budget started (its lease granted; None for swerl's loop,
        # whose grading keeps its own eval_timeout).
        self._budget_started: float | None = None

    @property
    def key(self) -> str:
        """Names this run's leases and artifacts: the episode id, plus the branch."""
        if self.branch is None:
            return self.spec.episode_id
        return f"{self.spec.episode_id}.b{self.branch}"

    @property
    def graded(self) -> bool:
        return self.status is not None and self.status.graded

    # -- control -------------------------------------------------------------------------------

    def cancel(self, reason: str) -> None:
        """Ends the episode CANCELLED at once (idempotent)."""
        if self._cancel_reason is None:
            self._cancel_reason = reason or "cancelled"
            if self._branches:
                # The branches end CANCELLED one by one, each with its result.
                for branch in self._branches:
                    branch.cancel(reason)
            elif self._work is not None:
                self._work.cancel()

    async def run(self) -> pb.RunEpisodeResponse:
        """Runs the episode; returns the final stream message (its `result`)."""
        self._work = asyncio.get_running_loop().create_task(self._body())
        if self._cancel_reason is not None:
            self._work.cancel()
        try:
            await self._work
        except asyncio.CancelledError:
            if self._cancel_reason is None:
                raise  # the whole call was cancelled: nothing to return
            self._end(EpisodeStatus.CANCELLED, "CANCELLED", self._cancel_reason)
        except SandboxBroken as err:
            self._end(EpisodeStatus.SANDBOX_BROKEN, "SANDBOX_BROKEN", err.message)
        except EpisodeInfraError as err:
            self._end(EpisodeStatus.INFRA_ERROR, err.reason, err.message)
        except PolicyUnavailable as err:
            self._end(EpisodeStatus.INFRA_ERROR, err.reason, err.message)
        finally:
            self._scoring.cancel()
        if self._last_branch_result is not None:
            return self._last_branch_result
        self._scoring.take_trunk_scores()
        self.reward = grading.outcome_reward(self.status, self.report)
        return await self._result()

    def _end(self, status: EpisodeStatus, reason: str = "", message: str = "") -> None:
        self.status = status
        self.error_reason, self.error_message = reason, message

    # -- the episode ---------------------------------------------------------------------------

    async def _body(self) -> None:
        forks: list[ForkedSandbox] = []
        try:
            await self._agent_part(forks)
        except BaseException:
            for forked in forks:  # forked, but the trunk's release was interrupted
                with contextlib.suppress(Exception):
                    await forked.release()
            raise
        # The agent's sandbox is released here, before the grading sandbox is leased.
        if forks:
            await self._run_branches(forks)
            return
        if self.graded and not self.spec.skip_evaluation:
            await self._evaluate()
        await self._scoring.settle()

    async def _agent_part(self, forks: list[ForkedSandbox]) -> None:
        """The agent loop in the episode's sandbox, then its patch, or the branches'
        sandboxes (into `forks`) when the trunk reached the fork."""
        spec = self.spec
        lease_started = time.monotonic()
        async with self._sandbox() as sandbox:
            if self.branch is None:  # a branch starts where its trunk stopped
                # A harness episode's prompts are its harness's own (counted by its session).
                prompt_tokens = 0 if self._harnessed else await self._first_prompt()
                self._emit(
                    pb.RunEpisodeResponse(
                        started=pb.EpisodeStarted(
                            lease_id=sandbox.lease_id,
                            sandbox_id=sandbox.sandbox_id,
                            node_id=sandbox.node_id,
                            lease_wait_duration=duration_pb(time.monotonic() - lease_started),
                            prompt_tokens=prompt_tokens,
                        )
                    )
                )
            agent_started = time.monotonic()
            agent_before = self.clock.agent_s  # a branch's share of its trunk's time
            harness = self.harness
            run_s = spec.wall_timeout_s - agent_before
            if self._harnessed:  # one budget: the harness leaves the grading its share
                self._budget_started = agent_started
                run_s = budget.harness_run_s(spec.wall_timeout_s, spec.eval_timeout_s)
            loop = asyncio.get_running_loop().create_task(self._drive(sandbox))
            # One watcher per episode (not per call): a lost lease stops the loop at once.
            lost = asyncio.ensure_future(sandbox.lost.wait())
            try:
                done, _ = await asyncio.wait(
                    {loop, lost},
                    timeout=max(0.0, run_s),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if loop in done:
                    loop.result()
                else:
                    loop.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await loop
                    if lost in done:
                        raise lease_lost(sandbox)
                    self._end(harness.timeout_status)
            finally:
                lost.cancel()
                if not loop.done():
                    loop.cancel()
                # Whatever the harness started stops before the sandbox is released or graded
                # (its budget, a lost lease, the trainer's abort, or its own end).
                with contextlib.suppress(Exception):
                    await harness.cancel()
                await self._close_model()
                self.clock.agent_s = agent_before + time.monotonic() - agent_started
            if self.graded:
                if self.submission is not None:
                    self.patch = self.submission.encode()
                else:
                    self.patch = await guarded(sandbox, sandbox.diff())
            elif self.status is None and spec.branching:  # the trunk is at the fork
                forks.extend(await branching.fork(self._provider, sandbox, spec))

    @property
    def _harnessed(self) -> bool:
        """Driven by a harness other than swerl's loop (it talks to a gateway session)."""
        return self.harness.name != DEFAULT_HARNESS

    async def _drive(self, sandbox: SandboxHandle) -> None:
        """The harness's prepare and run in the sandbox (swerl.agent.harnesses.driving); its
        submission is the episode's patch. A harness other than swerl's loop gets its own
        gateway session, watched while it runs."""
        model = None
        if self._harnessed:
            if self._deps.gateway is None:
                raise EpisodeInfraError("GATEWAY_UNAVAILABLE", "this agent has no model gateway")
            self.model = await EpisodeModel.open(await self._deps.gateway(), self.spec, self.key)
            model = self.model.model
        run = HarnessRun(spec=self.spec, sandbox=sandbox, agent_loop=self._agent_loop, model=model)
        driven = await driving.drive(self.harness, run, self.model)
        if driven.status is not None:
            self._end(driven.status, driven.reason, driven.detail)
            return
        if self.status is None and not (self.spec.branching and self.branch is None):
            self.submission = driven.submitted
            self._end(EpisodeStatus.SUBMITTED)

    async def _close_model(self) -> None:
        """Ends the harness's gateway session (no call is recorded after this) and keeps its
        records: they are the episode's samples."""
        if self.model is not None:
            with contextlib.suppress(Exception):
                await self.model.close()
            self.turns = len(self.model.session.tree.calls)  # its policy calls

    def _sandbox(self) -> contextlib.AbstractAsyncContextManager[SandboxHandle]:
        if self._forked is not None:
            return branching.holding(self._forked)
        spec = self.spec
        return self._provider.lease(
            spec.instance.image_name,
            owner=spec.lease_owner,
            instance_id=spec.instance.instance_id,
            request_id=f"{spec.episode_id}-agent",
            workdir=spec.config.workdir,
            avoid_node_ids=spec.avoid_node_ids,
        )

    async def _first_prompt(self) -> int:
        spec, config = self.spec, self.spec.config
        system = config.render("system_template")
        user = config.render(
            "instance_template", task=spec.instance.problem_statement, instance=spec.instance
        )
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return await self._policy.open(system, user)

    async def _agent_loop(self, sandbox: SandboxHandle) -> None:
        spec = self.spec
        # A branching trunk stops at the fork (no status yet); a branch starts there.
        stop = spec.branch_at if spec.branching and self.branch is None else spec.max_turns
        for index in range(self.turns, stop):
            turns_left = spec.max_turns - index - 1
            try:
                answer = await self._policy.respond(self.messages)
            except ContextExhausted as err:
                self._end(EpisodeStatus.LIMIT_CONTEXT, "", str(err))
                return
            self.clock.model_s += answer.model_s
            if answer.aborted:
                self._end(EpisodeStatus.ABORTED, "POLICY_ABORTED", "the policy aborted")
                return
            self.turns += 1
            acted = await self.actions.act(
                ActionTurn(sandbox, index, answer, turns_left, self.messages, self.steps)
            )
            self.tool_calls += acted.commands
            self.clock.env_s += acted.env_s
            if acted.submission is not None:
                self.submission = acted.submission
            self._scoring.judge_turn(
                index,
                answer.text,
                acted.judged_action,
                acted.judged_exit_code,
                acted.judged_output,
            )
            turn = acted.turn
            turn.index = index
            turn.prompt_tokens = answer.prompt_tokens
            turn.response_tokens = answer.response_tokens
            turn.context_trimmed = answer.context_trimmed
            if answer.context_trimmed:  # for `swerl inspect`, which marks where the trim was
                self.steps[-1]["context_trimmed"] = True
            turn.finish_reason = answer.finish_reason
            turn.model_duration.CopyFrom(duration_pb(answer.model_s))
            if turn.submitted:
                self._emit(pb.RunEpisodeResponse(turn=turn))
                self._end(EpisodeStatus.SUBMITTED)
                return
            turn.observation_tokens = await self._policy.observe(acted.observed)
            self._emit(pb.RunEpisodeResponse(turn=turn))
            limit = self.actions.limit()
            if limit is not None:
                self._end(EpisodeStatus.LIMIT_TURNS, *limit)
                return
        if stop == spec.max_turns:
            self._end(EpisodeStatus.LIMIT_TURNS)

    # -- after the loop: branches or grading ------------------------------------------------------

    async def _run_branches(self, forks: list[ForkedSandbox]) -> None:
        """One branch per forked sandbox, each run to its end (swerl.agent.loop.branching); the
        last result is the one `run` returns."""
        seeds = branching.seeds(self.spec, len(forks))
        self._branches = [
            self._branch(index, seed, forked)
            for index, (seed, forked) in enumerate(zip(seeds, forks, strict=True))
        ]
        if self._cancel_reason is not None:  # a cancel that came during the fork
            for branch in self._branches:
                branch.cancel(self._cancel_reason)
        self._last_branch_result = await branching.run_all(self._branches, self._emit)

    def _branch(self, index: int, seed: int, forked: ForkedSandbox) -> Episode:
        """A branch with a copy of this trunk's state at the fork."""
        emit = branching.tagged(self._emit, index)
        branch = Episode(self.spec, policy=self._policy.branch(seed), deps=self._deps, emit=emit)
        branch.branch, branch.sampling_seed, branch._forked = index, seed, forked
        branch.clock.started = self.clock.started
        branch.clock.model_s, branch.clock.env_s = self.clock.model_s, self.clock.env_s
        branch.clock.agent_s = self.clock.agent_s
        branch.messages = [dict(m) for m in self.messages]
        branch.steps = copy.deepcopy(self.steps)
        branch.turns, branch.tool_calls = self.turns, self.tool_calls
        branch.actions = self.actions.branch()
        # The trunk's turns are judged once: a branch shares the trunk's judgments.
        branch._scoring = self._scoring.for_branch(emit)
        return branch

    async def _evaluate(self) -> None:
        """Grades the patch (swerl.agent.judging.grading, within a harness episode's budget) and
        streams the report."""
        started = time.monotonic()
        try:
            self.report = await grading.evaluate_in_budget(
                self._provider, self.spec, self.key, self.patch, self._budget_started
            )
        finally:
            self.clock.eval_s = time.monotonic() - started
        self._emit(pb.RunEpisodeResponse(evaluation=self.report))
        grading.check_report(self.report)

    # -- result --------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        c = self.clock
        total = time.monotonic() - c.started
        m: dict[str, float] = {
            "turns": float(self.turns),
            "tool_calls": float(self.tool_calls),
            "model_query_time_sum": c.model_s,
            "env_execution_time_sum": c.env_s,
            "agent_run_time": c.agent_s,
            "total_time": total,
        }
        if c.eval_s is not None:
            m["eval_time"] = c.eval_s
        m["overhead_time"] = max(0.0, total - c.model_s - c.env_s - (c.eval_s or 0.0))
        if self.turns:
            m["time_per_turn"] = c.agent_s / self.turns
            m["model_query_time_avg"] = c.model_s / self.turns
        if self.tool_calls:
            m["env_execution_time_avg"] = c.env_s / self.tool_calls
        if not self._harnessed:
            m.update(self.actions.metrics())
        if self.model is not None:
            m.update(self.model.metrics())
        if total > 0:
            m["model_time_ratio"] = c.model_s / total
            m["env_time_ratio"] = c.env_s / total
            if c.eval_s is not None:
                m["eval_time_ratio"] = c.eval_s / total
        return m

    def _fill_records(self, result: pb.EpisodeResult) -> None:
        """The token records, written into the final message (swerl.agent.loop.records)."""
        records.fill_records(
            result,
            self._policy,
            reward=self.reward,
            shaped=self._scoring.shaped,
            dynamic_history=self.spec.dynamic_history,
            harness_records=None if self.model is None else (self.model.records or []),
        )

    async def _result(self) -> pb.RunEpisodeResponse:
        spec = self.spec
        deps = self._deps
        if deps.result_gate is not None:
            await deps.result_gate.wait_turn()
        # Built in place inside the final stream message: copying a message with whole token
        # records (constructor or CopyFrom) cost ~0.2 ms per 7k ids on the event loop.
        response = pb.RunEpisodeResponse()
        result = response.result
        result.episode_id = spec.episode_id
        if self.branch is not None:
            result.branch = self.branch
            result.sampling_seed = self.sampling_seed
        result.status = episode_status_pb(self.status)
        result.patch = self.patch
        result.error_reason = self.error_reason
        result.error_message = self.error_message[:2000]
        if self.reward is not None:
            result.reward = self.reward
        if self.report is not None:
            result.report.CopyFrom(self.report)
        if self._policy.recorded_turns or (self.model is not None and self.model.records):
            async with deps.records_slot or contextlib.nullcontext():
                await self._cpu(self._fill_records, result)
        self._scoring.fill(result, self.branch, spec.branch_at)
        result.metrics.update(self.metrics())
        if spec.artifact_dir and deps.write_artifacts is not None:
            with contextlib.suppress(OSError):
                result.artifact_dir = await deps.write_artifacts(self, result)
        return response

    async def _cpu(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._deps.executor, fn, *args)
