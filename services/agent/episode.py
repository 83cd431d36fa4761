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
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import signal
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from swerl.agent.config import AgentConfig
from swerl.agent.errors import EpisodeInfraError
from swerl.agent.judging import (
    StepJudge,
    StepScore,
    StepScoreState,
    TurnToJudge,
    trajectory_reward,
    turn_reward,
)
from swerl.agent.modes import ContextExhausted, Policy
from swerl.agent.pacing import IterationGate
from swerl.agent.policy import PolicyUnavailable
from swerl.agent.protocol import parse_action, render_format_error, render_observation, submission
from swerl.agent.sandbox import (
    SANDBOX_NOT_RUNNING,
    ForkedSandbox,
    SandboxHandle,
    SandboxProvider,
)
from swerl.agent.status import EpisodeStatus
from swerl.agent.tokens import TokenRecordData
from swerl.agent.v1 import agent_pb2 as pb
from swerl.agent.wire import episode_status_pb, step_score_pb
from swerl.chassis.timeconv import duration_pb
from swerl.exec.v1 import evaluate_pb2

T = TypeVar("T")
_OUTPUT_HEAD_CHARS = 1000
_RESTARTED_NOTE = (
    "[The sandbox's processes had all died (a command killed them), so it was started again"
    " before this command: files are kept; background processes, the shell's variables and"
    " its working directory are gone.]\n"
)


class SandboxBroken(Exception):
    """The policy's own command broke its sandbox beyond repair (ends SANDBOX_BROKEN)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def killed_by(exit_code: int, timed_out: bool) -> int | None:
    """The signal that ended a command (exit code 128+N by the shell's convention); None for
    an ordinary exit or a timeout (the node's own kill)."""
    if timed_out or not 128 < exit_code < 128 + 65:
        return None
    return exit_code - 128


def _killed_note(signum: int) -> str:
    try:
        name = f" ({signal.Signals(signum).name})"
    except ValueError:
        name = ""
    return f"[The command, or the shell running it, was killed by signal {signum}{name}.]\n"


@contextlib.asynccontextmanager
async def _holding(forked: ForkedSandbox) -> AsyncIterator[SandboxHandle]:
    """A branch's forked sandbox, held like a lease: released at the end whatever happens
    (shielded, so a cancelled branch still gives it back)."""
    try:
        yield forked
    finally:
        await asyncio.shield(forked.release())


@dataclass(frozen=True)
class PrmSpec:
    enabled: bool = False
    endpoint: str = ""
    m: int = 0
    coef: float = 0.0
    seed: int = 0
    timeout_s: float = 120.0


@dataclass(frozen=True)
class EpisodeSpec:
    episode_id: str
    instance: evaluate_pb2.SweInstance
    config: AgentConfig
    api: pb.PolicyApi
    endpoint: str
    model: str
    sampling_params: dict[str, Any]
    request_timeout_s: float
    max_turns: int
    max_context_tokens: int
    max_new_tokens: int
    wall_timeout_s: float
    command_timeout_s: float
    eval_timeout_s: float
    dynamic_history: bool = False
    return_routed_experts: bool = False
    artifact_dir: str = ""
    skip_evaluation: bool = False
    env: dict[str, str] = field(default_factory=dict)
    owner: str = ""
    prm: PrmSpec = PrmSpec()
    # EpisodeOptions.branch: the trunk runs `branch_at` turns, then `branch_count` branches go on.
    branch_at: int = 0
    branch_count: int = 0

    @property
    def branching(self) -> bool:
        return self.branch_count > 0


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
        self._judge = judge
        self.clock = Clock()
        self.status: EpisodeStatus | None = None
        self.error_reason = ""
        self.error_message = ""
        self.messages: list[dict[str, str]] = []
        self.steps: list[dict[str, Any]] = []
        self.turns = 0
        self.tool_calls = 0
        self.submission: str | None = None
        self.patch = b""
        self.report: evaluate_pb2.EvaluationReport | None = None
        self.reward: float | None = None
        self.scores: dict[int, StepScore] = {}
        self._prm_tasks: list[asyncio.Task[None]] = []
        self._work: asyncio.Task[None] | None = None
        self._cancel_reason: str | None = None
        # The policy's last command ended killed by a signal: a sandbox found dead after it is
        # the policy's doing.
        self._last_killed = False
        # Branching: a branch's index, seed and forked sandbox (None for a trunk or a plain
        # episode); a trunk's running branches; the trunk's PRM scores a branch shares.
        self.branch: int | None = None
        self.sampling_seed = 0
        self._forked: ForkedSandbox | None = None
        self._branches: list[Episode] = []
        self._trunk_scores: dict[int, StepScore] = {}
        self._trunk_prm: list[asyncio.Task[None]] = []
        self._last_branch_result: pb.RunEpisodeResponse | None = None

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
            for task in self._prm_tasks:
                task.cancel()
        if self._last_branch_result is not None:
            return self._last_branch_result
        if self._trunk_scores:
            self.scores = {**self._trunk_scores, **self.scores}
        if self.status is EpisodeStatus.SANDBOX_BROKEN:
            self.reward = -1.0  # a failed attempt: the policy broke what it was to fix
        elif not self.graded or self.report is None:
            self.reward = None
        return await self._result()

    def _end(self, status: EpisodeStatus, reason: str = "", message: str = "") -> None:
        self.status = status
        self.error_reason, self.error_message = reason, message

    # -- the episode ---------------------------------------------------------------------------

    async def _body(self) -> None:
        spec = self.spec
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
        if self.graded and not spec.skip_evaluation:
            await self._evaluate()
        if self._prm_tasks or self._trunk_prm:
            # The trunk's judgments are shared by its branches: shielded from this one's end.
            shared = [asyncio.shield(task) for task in self._trunk_prm]
            await asyncio.gather(*shared, *self._prm_tasks, return_exceptions=True)

    async def _agent_part(self, forks: list[ForkedSandbox]) -> None:
        """The agent loop in the episode's sandbox, then its patch, or the branches'
        sandboxes (into `forks`) when the trunk reached the fork."""
        spec = self.spec
        lease_started = time.monotonic()
        async with self._sandbox() as sandbox:
            if self.branch is None:  # a branch starts where its trunk stopped
                prompt_tokens = await self._first_prompt()
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
            loop = asyncio.get_running_loop().create_task(self._agent_loop(sandbox))
            # One watcher per episode (not per call): a lost lease stops the loop at once.
            lost = asyncio.ensure_future(sandbox.lost.wait())
            try:
                done, _ = await asyncio.wait(
                    {loop, lost},
                    timeout=max(0.0, spec.wall_timeout_s - agent_before),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if loop in done:
                    loop.result()
                else:
                    loop.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await loop
                    if lost in done:
                        reason, message = sandbox.lost_detail()
                        raise EpisodeInfraError("LEASE_LOST", f"{reason}: {message}")
                    self._end(EpisodeStatus.LIMIT_TIME)
            finally:
                lost.cancel()
                if not loop.done():
                    loop.cancel()
                self.clock.agent_s = agent_before + time.monotonic() - agent_started
            if self.graded:
                if self.submission is not None:
                    self.patch = self.submission.encode()
                else:
                    self.patch = await self._guarded(sandbox, sandbox.diff())
            elif self.status is None and spec.branching:  # the trunk is at the fork
                forks.extend(await self._fork(sandbox))

    def _sandbox(self) -> contextlib.AbstractAsyncContextManager[SandboxHandle]:
        if self._forked is not None:
            return _holding(self._forked)
        spec = self.spec
        return self._provider.lease(
            spec.instance.image_name,
            owner=spec.owner or f"agent/{spec.episode_id}",
            instance_id=spec.instance.instance_id,
            request_id=f"{spec.episode_id}-agent",
            workdir=spec.config.workdir,
        )

    # -- branching -----------------------------------------------------------------------------

    async def _fork(self, sandbox: SandboxHandle) -> list[ForkedSandbox]:
        """The branches' sandboxes. Shielded: a cancel during the fork still gets the leases
        back, so they are released rather than left to expire."""
        spec = self.spec
        fork = asyncio.ensure_future(
            self._guarded(
                sandbox,
                self._provider.fork(
                    sandbox,
                    spec.branch_count,
                    owner=spec.owner or f"agent/{spec.episode_id}",
                    request_id=f"{spec.episode_id}-fork",
                ),
            )
        )
        try:
            return await asyncio.shield(fork)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                for forked in await fork:
                    await forked.release()
            raise

    async def _run_branches(self, forks: list[ForkedSandbox]) -> None:
        """Runs one branch per forked sandbox to its end; emits each result as it comes and
        keeps the last for `run` to return."""
        base = self.spec.sampling_params.get("sampling_seed")
        if not isinstance(base, int):
            base = zlib.crc32(self.spec.episode_id.encode())
        self._branches = [
            self._branch(index, base + 1 + index, forked) for index, forked in enumerate(forks)
        ]
        if self._cancel_reason is not None:  # a cancel that came during the fork
            for branch in self._branches:
                branch.cancel(self._cancel_reason)
        runs = [asyncio.ensure_future(branch.run()) for branch in self._branches]
        try:
            for n, finished in enumerate(asyncio.as_completed(runs)):
                response = await finished
                if n + 1 < len(runs):
                    self._emit(response)
                else:
                    self._last_branch_result = response
        finally:
            for run in runs:  # the whole call went away: every branch releases its sandbox
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

    def _branch(self, index: int, seed: int, forked: ForkedSandbox) -> Episode:
        """A branch with a copy of this trunk's state at the fork."""
        emit = self._emit

        def tagged(message: pb.RunEpisodeResponse) -> None:
            kind = message.WhichOneof("kind")
            if kind == "turn":
                message.turn.branch = index
            elif kind == "prm_score":
                message.prm_score.branch = index
            elif kind == "evaluation":
                return  # the report is in the branch's result
            emit(message)

        branch = Episode(
            self.spec,
            policy=self._policy.branch(seed),
            deps=self._deps,
            emit=tagged,
            judge=self._judge,
        )
        branch.branch, branch.sampling_seed, branch._forked = index, seed, forked
        branch.clock.started = self.clock.started
        branch.clock.model_s, branch.clock.env_s = self.clock.model_s, self.clock.env_s
        branch.clock.agent_s = self.clock.agent_s
        branch.messages = [dict(m) for m in self.messages]
        branch.steps = copy.deepcopy(self.steps)
        branch.turns, branch.tool_calls = self.turns, self.tool_calls
        branch._last_killed = self._last_killed
        # The trunk's turns are judged once: a branch waits for the pending judgments and
        # reads the trunk's scores (the dict they land in) when it builds its result.
        branch._trunk_prm = list(self._prm_tasks)
        branch._trunk_scores = self.scores
        return branch

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
            self.messages.append({"role": "assistant", "content": answer.text})
            turn = await self._act(sandbox, index, answer.text, turns_left)
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
            turn.observation_tokens = await self._policy.observe(self.messages[-1]["content"])
            self._emit(pb.RunEpisodeResponse(turn=turn))
        if stop == spec.max_turns:
            self._end(EpisodeStatus.LIMIT_TURNS)

    async def _act(
        self, sandbox: SandboxHandle, index: int, text: str, turns_left: int
    ) -> pb.EpisodeTurn:
        spec, config = self.spec, self.spec.config
        action = parse_action(text)
        step: dict[str, Any] = {"turn": index, "response": text}
        self.steps.append(step)
        if action.command is None:
            observation = render_format_error(
                config, n_blocks=action.n_blocks, turns_left=turns_left
            )
            self.messages.append({"role": "user", "content": observation})
            step.update(format_error=True, n_blocks=action.n_blocks)
            self._schedule_prm(index, text, None, 0, "")
            return pb.EpisodeTurn(format_error=True)
        env = {**config.env, **spec.env}
        started = time.monotonic()
        try:
            result = await sandbox.run(
                action.command, timeout_s=spec.command_timeout_s, env=env, cwd=config.workdir
            )
        except EpisodeInfraError as err:
            step.update(action=action.command, sandbox_lost=err.message[:500])
            if err.reason == SANDBOX_NOT_RUNNING and self._last_killed:
                raise SandboxBroken(err.message) from err
            raise
        exec_s = time.monotonic() - started
        self.clock.env_s += exec_s
        self.tool_calls += 1
        output = result.output.decode(errors="replace")
        submitted = submission(output, result.exit_code)
        signum = killed_by(result.exit_code, result.timed_out)
        restarted = bool(getattr(result, "sandbox_restarted", False))
        self._last_killed = signum is not None
        step.update(
            action=action.command,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            exec_s=round(exec_s, 4),
            output_bytes=len(result.output),
        )
        if restarted:
            step["sandbox_restarted"] = True
        turn = pb.EpisodeTurn(
            action=action.command,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            output_head=output[:_OUTPUT_HEAD_CHARS],
            output_bytes=len(result.output) + result.bytes_dropped,
            submitted=submitted is not None,
            exec_duration=duration_pb(exec_s),
        )
        if submitted is not None:
            self.submission = submitted
            self.messages.append({"role": "user", "content": output})
        else:
            notes = (_RESTARTED_NOTE if restarted else "") + (
                _killed_note(signum) if signum is not None else ""
            )
            observation = await self._cpu(
                lambda: render_observation(
                    config,
                    exit_code=result.exit_code,
                    output=notes + output,
                    timed_out=result.timed_out,
                    timeout_s=spec.command_timeout_s,
                    turns_left=turns_left,
                )
            )
            self.messages.append({"role": "user", "content": observation})
        self._schedule_prm(index, text, action.command, result.exit_code, output)
        return turn

    async def _guarded(self, sandbox: SandboxHandle, work: Awaitable[T]) -> T:
        """Awaits `work` unless the lease is lost first (then INFRA_ERROR/LEASE_LOST)."""
        task = asyncio.ensure_future(work)
        lost = asyncio.ensure_future(sandbox.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            if sandbox.lost.is_set() and task.exception() is not None:
                reason, message = sandbox.lost_detail()
                raise EpisodeInfraError("LEASE_LOST", f"{reason}: {message}")
            return task.result()
        reason, message = sandbox.lost_detail()
        raise EpisodeInfraError("LEASE_LOST", f"{reason}: {message}")

    async def _evaluate(self) -> None:
        spec = self.spec
        started = time.monotonic()
        try:
            if not self.patch.strip():
                # Nothing to apply: the grade needs no sandbox (Evaluate would answer the same).
                self.report = evaluate_pb2.EvaluationReport(
                    instance_id=spec.instance.instance_id,
                    status=evaluate_pb2.EVALUATION_STATUS_UNRESOLVED,
                    error_reason="EMPTY_PATCH",
                    error_message="the agent changed nothing",
                )
            else:
                async with self._provider.lease(
                    spec.instance.image_name,
                    owner=spec.owner or f"agent/{spec.episode_id}",
                    instance_id=spec.instance.instance_id,
                    request_id=f"{self.key}-eval",
                    workdir=None,
                ) as grader:
                    self.report = await self._guarded(
                        grader, grader.evaluate(spec.instance, self.patch, spec.eval_timeout_s)
                    )
        finally:
            self.clock.eval_s = time.monotonic() - started
        report = self.report
        assert report is not None
        self._emit(pb.RunEpisodeResponse(evaluation=report))
        if report.status == evaluate_pb2.EVALUATION_STATUS_INFRA_ERROR:
            raise EpisodeInfraError(
                "EVALUATION_INFRA_ERROR", f"{report.error_reason}: {report.error_message}"
            )
        resolved = report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
        self.reward = 1.0 if resolved else -1.0

    # -- PRM ---------------------------------------------------------------------------------

    def _schedule_prm(
        self, index: int, response: str, action: str | None, exit_code: int, output: str
    ) -> None:
        if not self.spec.prm.enabled:
            return
        if action is None:
            self._score(StepScore(index, StepScoreState.NOT_JUDGED))
            return
        if self._judge is None:
            self._score(StepScore(index, StepScoreState.FAILED))
            return
        turn = TurnToJudge(
            turn_index=index,
            issue=self.spec.instance.problem_statement,
            response=response,
            action=action,
            exit_code=exit_code,
            output=output,
        )
        self._prm_tasks.append(asyncio.ensure_future(self._judge_turn(self._judge, turn)))

    async def _judge_turn(self, judge: StepJudge, turn: TurnToJudge) -> None:
        try:
            judged = await asyncio.wait_for(judge.judge(turn), self.spec.prm.timeout_s)
        except Exception:  # a judge that fails costs its turn's score, never the episode
            judged = StepScore(turn.turn_index, StepScoreState.FAILED)
        # Keyed by the turn it was asked for, whatever the judge wrote: no score changes turns.
        self._score(StepScore(turn.turn_index, judged.state, judged.score, judged.valid_votes))

    def _score(self, score: StepScore) -> None:
        self.scores[score.turn_index] = score
        self._emit(pb.RunEpisodeResponse(prm_score=step_score_pb(score)))

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
        if total > 0:
            m["model_time_ratio"] = c.model_s / total
            m["env_time_ratio"] = c.env_s / total
            if c.eval_s is not None:
                m["eval_time_ratio"] = c.eval_s / total
        return m

    @staticmethod
    def _fill_record(
        message: pb.TokenRecord, record: TokenRecordData, reward: float | None
    ) -> None:
        record.check()
        message.prompt_ids.extend(record.prompt_ids)
        message.response_ids.extend(record.response_ids)
        message.loss_mask.extend(record.loss_mask)
        message.logprobs.extend(record.logprobs)
        message.weight_versions.extend(record.weight_versions)
        message.top_p_token_ids.extend(record.top_p_token_ids)
        message.top_p_token_offsets.extend(record.top_p_token_offsets)
        if record.routed_experts:
            message.routed_experts = record.routed_experts
            message.routed_experts_per_token = record.experts_per_token
        if reward is not None:
            message.reward = reward

    def _shaped(self, turn_index: int | None) -> float | None:
        """The reward of the whole trajectory (`turn_index` None) or of one turn, with the
        PRM's step scores folded in when the episode asked for them."""
        if self.reward is None:
            return None
        prm = self.spec.prm
        if not prm.enabled or not prm.coef:
            return self.reward
        if turn_index is None:
            return trajectory_reward(self.reward, self.scores.values(), prm.coef)
        return turn_reward(self.reward, self.scores.get(turn_index), prm.coef)

    def _fill_records(self, result: pb.EpisodeResult) -> None:
        """The token records, written into the final message (in the CPU pool: a long
        episode's records hold hundreds of thousands of ids)."""
        if self.spec.dynamic_history:
            for index, record in enumerate(self._policy.turn_records()):
                self._fill_record(result.turns.add(), record, self._shaped(index))
        else:
            # One record per chain, each with the episode's reward; a lone chain (no trim)
            # stays in `trajectory`, where readers that predate chains find it.
            records = self._policy.whole_records()
            reward = self._shaped(None)
            if len(records) == 1:
                self._fill_record(result.trajectory, records[0], reward)
            else:
                for record in records:
                    self._fill_record(result.chains.add(), record, reward)

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
        if self._policy.recorded_turns:
            async with deps.records_slot or contextlib.nullcontext():
                await self._cpu(self._fill_records, result)
        if spec.prm.enabled:
            result.step_scores.extend(step_score_pb(self.scores[i]) for i in sorted(self.scores))
            if self.branch is not None:  # its own turns' scores, after the trunk's
                for score in result.step_scores:
                    if score.turn_index >= spec.branch_at:
                        score.branch = self.branch
        result.metrics.update(self.metrics())
        if spec.artifact_dir and deps.write_artifacts is not None:
            with contextlib.suppress(OSError):
                result.artifact_dir = await deps.write_artifacts(self, result)
        return response

    async def _cpu(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._deps.executor, fn, *args)


def sampling_params_of(struct: Mapping[str, Any]) -> dict[str, Any]:
    """Struct numbers are floats; SGLang wants ints for the integer keys."""
    params = dict(struct)
    for key in ("top_k", "max_new_tokens", "min_new_tokens", "sampling_seed", "n"):
        value = params.get(key)
        if isinstance(value, float) and value.is_integer():
            params[key] = int(value)
    if isinstance(params.get("stop_token_ids"), list):
        params["stop_token_ids"] = [int(x) for x in params["stop_token_ids"]]
    return params
