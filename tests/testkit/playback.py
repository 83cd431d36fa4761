"""A real grpc.aio AgentService that plays back canned RunEpisode responses.

It stands at our own service boundary (the agent contract), so the plugin's client runs against
a real server on port 0: real streams, real cancellation, real deadlines. Each episode follows a
`Scenario` chosen from its `start`; the servicer records what the client sent (starts, cancels)
and which calls the client cancelled.
"""

from __future__ import annotations

import asyncio
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format

from swerl.agent.v1 import agent_pb2, agent_pb2_grpc
from swerl.chassis.timeconv import duration_pb
from swerl.exec.v1 import evaluate_pb2

S = agent_pb2.EpisodeStatus
# The exec node every playback episode reports (EpisodeStarted.node_id).
PLAYBACK_NODE = "node-1"
PROMPT = [151644, 8948, 198, 2610, 525, 264, 10950, 151645, 198, 151644, 872, 198]


@dataclass
class Turn:
    """One policy turn: the model's tokens (with logprobs) and the observation tokens after."""

    response: list[int]
    logprobs: list[float]
    observation: list[int]


def turns(n: int) -> list[Turn]:
    """n distinct turns; the last has no observation (the episode ended on it)."""
    out = []
    for i in range(n):
        response = [1000 + 10 * i + k for k in range(3)]
        observation = [] if i == n - 1 else [2000 + 10 * i + k for k in range(2)]
        out.append(Turn(response, [-0.25 * (k + 1) - i for k in range(3)], observation))
    return out


def trajectory(ts: list[Turn], reward: float | None) -> agent_pb2.TokenRecord:
    record = agent_pb2.TokenRecord(prompt_ids=PROMPT, weight_versions=["7"] * len(ts))
    for t in ts:
        record.response_ids.extend(t.response + t.observation)
        record.loss_mask.extend([1] * len(t.response) + [0] * len(t.observation))
        record.logprobs.extend(t.logprobs + [0.0] * len(t.observation))
    if reward is not None:
        record.reward = reward
    return record


def per_turn_records(
    ts: list[Turn], reward: float | None, shaping: list[float] | None = None
) -> list[agent_pb2.TokenRecord]:
    records, context = [], list(PROMPT)
    for i, t in enumerate(ts):
        record = agent_pb2.TokenRecord(
            prompt_ids=context,
            response_ids=t.response,
            loss_mask=[1] * len(t.response),
            logprobs=t.logprobs,
            weight_versions=["7"],
        )
        if reward is not None:
            record.reward = reward + (shaping[i] if shaping else 0.0)
        records.append(record)
        context = context + t.response + t.observation
    return records


# Values per token of the playback's routed experts (2 layers x top-2).
EXPERTS_PER_TOKEN = 4


def playback_top_p(position: int, token: int) -> list[int]:
    """The kept top-p set the playback policy reports for a sampled token."""
    return [token, token + 1][: 1 + position % 2]


def playback_experts(token: int) -> list[int]:
    """The experts the playback policy routed a token to (layer by layer, top-2 each)."""
    return [(token + k) % 64 + 1 for k in range(EXPERTS_PER_TOKEN)]


def asks_top_p(start: agent_pb2.EpisodeStart) -> bool:
    params = json_format.MessageToDict(start.policy.sampling_params)
    return bool((params.get("custom_params") or {}).get("return_top_p_token_ids"))


def add_replay(record: agent_pb2.TokenRecord, start: agent_pb2.EpisodeStart) -> None:
    """What the agent adds to a record when the start asks for replay data."""
    if asks_top_p(start):
        ids, offsets, position = [], [0], 0
        for token, mask in zip(record.response_ids, record.loss_mask, strict=True):
            if mask:
                ids += playback_top_p(position, token)
                position += 1
            else:
                position = 0
            offsets.append(len(ids))
        record.top_p_token_ids.extend(ids)
        record.top_p_token_offsets.extend(offsets)
    if start.policy.return_routed_experts:
        sequence = [*record.prompt_ids, *record.response_ids][:-1]
        values = array("i", [e for token in sequence for e in playback_experts(token)])
        if sys.byteorder != "little":
            values.byteswap()
        record.routed_experts = values.tobytes()
        record.routed_experts_per_token = EXPERTS_PER_TOKEN


METRICS = {
    "turns": 3.0,
    "tool_calls": 2.0,
    "model_query_time_sum": 1.5,
    "env_execution_time_sum": 0.6,
    "eval_time": 0.4,
    "agent_run_time": 2.2,
    "total_time": 2.8,
    "overhead_time": 0.3,
    "time_per_turn": 0.73,
    "model_query_time_avg": 0.5,
    "env_execution_time_avg": 0.3,
    "model_time_ratio": 0.54,
    "env_time_ratio": 0.21,
    "eval_time_ratio": 0.14,
}


def result(
    start: agent_pb2.EpisodeStart,
    status: int = S.EPISODE_STATUS_SUBMITTED,
    *,
    n_turns: int = 3,
    reward: float | None = 1.0,
    shaping: list[float] | None = None,
    error_reason: str = "",
    error_message: str = "",
    with_replay: bool = True,
) -> agent_pb2.EpisodeResult:
    """The result an agent would send for `start` (honouring options.dynamic_history)."""
    ts = turns(n_turns)
    out = agent_pb2.EpisodeResult(
        episode_id=start.episode_id,
        status=status,
        patch=b"diff --git a/x b/x\n",
        metrics=METRICS,
        artifact_dir=f"/artifacts/{start.instance.instance_id}__{start.episode_id}",
        error_reason=error_reason,
        error_message=error_message or ("detail" if error_reason else ""),
    )
    if reward is not None:
        out.reward = reward
        out.report.CopyFrom(
            evaluate_pb2.EvaluationReport(
                instance_id=start.instance.instance_id,
                status=evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
                if reward > 0
                else evaluate_pb2.EVALUATION_STATUS_UNRESOLVED,
                patch_applied=True,
                total_duration=duration_pb(0.4),
            )
        )
    if start.options.dynamic_history:
        out.turns.extend(per_turn_records(ts, reward, shaping))
    elif n_turns:
        shaped = (
            None if reward is None else reward + (sum(shaping) / len(shaping) if shaping else 0)
        )
        out.trajectory.CopyFrom(trajectory(ts, shaped))
    else:
        out.trajectory.CopyFrom(agent_pb2.TokenRecord(prompt_ids=PROMPT))
    if with_replay:
        for record in [*out.turns, *([out.trajectory] if out.HasField("trajectory") else [])]:
            if record.response_ids:
                add_replay(record, start)
    return out


def branch_turns(n: int, at_turn: int, branch: int) -> list[Turn]:
    """A branch's n turns: the trunk's first `at_turn` as in `turns(n)`, then its own (token
    ids shifted by the branch, so branches differ after the fork)."""
    out = turns(n)
    for i in range(at_turn, n):
        shift = 100 * (branch + 1)
        out[i] = Turn(
            [tok + shift for tok in out[i].response],
            out[i].logprobs,
            [tok + shift for tok in out[i].observation],
        )
    return out


def branch_result(
    start: agent_pb2.EpisodeStart,
    branch: int,
    status: int = S.EPISODE_STATUS_SUBMITTED,
    *,
    n_turns: int = 4,
    reward: float | None = 1.0,
    error_reason: str = "",
) -> agent_pb2.EpisodeResult:
    """Branch `branch`'s result of a branching start (EpisodeOptions.branch)."""
    out = result(
        start, status, n_turns=n_turns, reward=reward, error_reason=error_reason, with_replay=False
    )
    at_turn = start.options.branch.at_turn
    ts = branch_turns(n_turns, at_turn, branch)
    if start.options.dynamic_history:
        del out.turns[:]
        out.turns.extend(per_turn_records(ts, reward))
    elif n_turns:
        out.trajectory.CopyFrom(trajectory(ts, reward))
    out.branch = branch
    out.sampling_seed = 1000 + 1 + branch
    out.artifact_dir = f"{out.artifact_dir}.b{branch}"
    return out


@dataclass
class Scenario:
    """How the playback agent answers one RunEpisode call."""

    result: agent_pb2.EpisodeResult | None = None
    turns_before: int = 2  # `turn` messages streamed before the result (or the wait)
    gap_s: float = 0.0  # pause between streamed messages
    wait_for_cancel: bool = False  # run until the client sends cancel, then answer CANCELLED
    ignore_cancel: bool = False  # run until the client cancels the call itself
    abort_code: grpc.StatusCode | None = None  # fail the call (after the streamed turns)
    end_without_result: bool = False
    delay_before_result_s: float = 0.0
    # Several results (a branching episode's, one per branch); `result` is then unused.
    results: list[agent_pb2.EpisodeResult] | None = None


@dataclass
class PlaybackAgent(agent_pb2_grpc.AgentServiceServicer):
    scenario_for: Callable[[agent_pb2.EpisodeStart], Scenario]
    starts: list[agent_pb2.EpisodeStart] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    cancelled_calls: list[str] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    # Calls parked past their last message (ignore_cancel): a cancel now reaches the handler's
    # own await. One that lands while the handler waits for gRPC to send a message is raised in
    # gRPC's loop, not here: the handler is only closed when its generator is collected.
    parked: int = 0

    async def RunEpisode(self, request_iterator, context):
        first = await anext(aiter(request_iterator))
        start = first.start
        self.starts.append(start)
        self.metadata.append(dict(context.invocation_metadata()))
        scenario = self.scenario_for(start)
        cancelled = asyncio.Event()

        async def watch_requests() -> None:
            async for request in request_iterator:
                if request.WhichOneof("kind") == "cancel":
                    self.cancels.append(start.episode_id)
                    cancelled.set()

        watcher = asyncio.ensure_future(watch_requests())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            yield agent_pb2.RunEpisodeResponse(
                started=agent_pb2.EpisodeStarted(
                    lease_id="lease-1", sandbox_id="sbx-1", node_id=PLAYBACK_NODE
                )
            )
            for i in range(scenario.turns_before):
                await asyncio.sleep(scenario.gap_s)
                yield agent_pb2.RunEpisodeResponse(
                    turn=agent_pb2.EpisodeTurn(index=i, action="ls", response_tokens=3)
                )
            if scenario.abort_code is not None:
                await context.abort(scenario.abort_code, "playback failure")
            if scenario.end_without_result:
                return
            if scenario.ignore_cancel:
                self.parked += 1
                await asyncio.Event().wait()
            if scenario.wait_for_cancel:
                await cancelled.wait()
                count = start.options.branch.count
                if count:  # every branch ends CANCELLED with its partial trajectory
                    for b in range(count):
                        partial = branch_result(
                            start, b, S.EPISODE_STATUS_CANCELLED, n_turns=3, reward=None
                        )
                        yield agent_pb2.RunEpisodeResponse(result=partial)
                    return
                partial = result(start, S.EPISODE_STATUS_CANCELLED, n_turns=2, reward=None)
                yield agent_pb2.RunEpisodeResponse(result=partial)
                return
            await asyncio.sleep(scenario.delay_before_result_s)
            if scenario.results is not None:
                for answer in scenario.results:
                    yield agent_pb2.RunEpisodeResponse(result=answer)
                return
            answer = scenario.result if scenario.result is not None else result(start)
            yield agent_pb2.RunEpisodeResponse(result=answer)
        except asyncio.CancelledError:
            self.cancelled_calls.append(start.episode_id)
            raise
        finally:
            self.active -= 1
            watcher.cancel()


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Waits until `predicate()` holds; fails the test after `timeout_s`."""
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not met within {timeout_s}s")


class PlaybackServer:
    """A grpc.aio server on 127.0.0.1:0 serving a PlaybackAgent."""

    def __init__(self, agent: PlaybackAgent) -> None:
        self.agent = agent
        self.server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(agent, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"

    async def __aenter__(self) -> PlaybackServer:
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(0)
