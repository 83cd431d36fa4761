"""The Agent's PRM judge: `swerl.agent.episode.StepJudge` over PrmService.

The agent service takes a `judge_factory` that it calls once per PRM-enabled episode with the
episode's `PrmSpec`; `PrmJudgeFactory` is that factory. Each episode gets a `PrmStepJudge`, which
the episode calls once per executed turn (format-error turns it marks NOT_JUDGED itself) and
which answers `(StepScoreState, score, valid_votes)`.

The judge keeps the episode's own step history (command, exit code, ends of the output) from the
turns it is given, in order, and records every turn index it never saw before the current one as
a format error, so the history the PRM model reads matches the episode turn for turn. Seeds are
derived by the PRM service from (base seed, episode, step, vote); the episode key is the agent's
episode id when its step carries one, else a random id per episode, which still keeps the
episodes of a group from sharing seeds.

    factory = PrmJudgeFactory(token=prm_token, default_endpoint="head:18092")
    AgentServer(settings, judge_factory=factory)   # ... and `await factory.close()` at shutdown
"""

from __future__ import annotations

import uuid
from typing import Protocol

import grpc

from swerl.agent.v1 import agent_pb2
from swerl.chassis.client import make_channel
from swerl.prm.client import PrmClient
from swerl.prm.episode import HISTORY_OUTPUT_END_CHARS
from swerl.prm.prompt import CurrentStep, HistoryStep, StepToJudge
from swerl.prm.scoring import step_score_of


class AgentStep(Protocol):
    """What the agent hands the judge per turn (`swerl.agent.episode.StepToJudge`)."""

    turn_index: int
    issue: str
    response: str
    action: str
    exit_code: int
    output: str


class PrmSpecLike(Protocol):
    endpoint: str
    m: int
    seed: int
    timeout_s: float


def _ends(output: str) -> tuple[str, str]:
    if len(output) <= 2 * HISTORY_OUTPUT_END_CHARS:
        return output, ""
    return output[:HISTORY_OUTPUT_END_CHARS], output[-HISTORY_OUTPUT_END_CHARS:]


class PrmStepJudge:
    """Judges one episode's turns through a PrmClient (one instance per episode)."""

    def __init__(
        self,
        client: PrmClient,
        *,
        episode_id: str | None = None,
        votes: int = 0,
        seed: int = 0,
        timeout_s: float | None = None,
    ) -> None:
        self._client = client
        self._episode_id = episode_id or f"episode-{uuid.uuid4().hex}"
        self._votes = votes
        self._seed = seed
        self._timeout_s = timeout_s
        self._seen: dict[int, HistoryStep] = {}

    def _history_before(self, turn_index: int) -> tuple[HistoryStep, ...]:
        # Turns never handed over were format errors: nothing ran.
        blank = HistoryStep(action="", exit_code=0, format_error=True)
        return tuple(self._seen.get(i, blank) for i in range(turn_index))

    async def judge(self, step: AgentStep) -> tuple[int, float, int]:
        """`(agent StepScoreState, score, valid_votes)` for one executed turn; never raises
        for PRM trouble (it comes back as FAILED)."""
        index = step.turn_index
        # Taken before the first await, so concurrent judgments see the turns before them.
        history = self._history_before(index)
        head, tail = _ends(step.output)
        self._seen[index] = HistoryStep(step.action, step.exit_code, head, tail)
        episode_id = getattr(step, "episode_id", "") or self._episode_id
        verdict = await self._client.judge_step(
            StepToJudge(
                episode_id=episode_id,
                step_index=index,
                issue=step.issue,
                history=history,
                step=CurrentStep(step.response, step.action, step.exit_code, step.output),
            ),
            votes=self._votes,
            seed=self._seed,
            timeout_s=self._timeout_s,
        )
        score = step_score_of(index, verdict)
        state = agent_pb2.StepScoreState.Value(f"STEP_SCORE_STATE_{score.state.value}")
        return state, score.score, score.valid_votes


class PrmJudgeFactory:
    """`judge_factory` for the agent service: one channel per PRM endpoint, shared by episodes."""

    def __init__(
        self,
        *,
        token: str | None = None,
        default_endpoint: str | None = None,
        tls_ca_file: str | None = None,
    ) -> None:
        self._token = token
        self._default_endpoint = default_endpoint or ""
        self._tls_ca_file = tls_ca_file
        self._channels: dict[str, grpc.aio.Channel] = {}

    def __call__(self, spec: PrmSpecLike, episode_id: str | None = None) -> PrmStepJudge:
        endpoint = spec.endpoint or self._default_endpoint
        if not endpoint:
            raise ValueError("PRM is enabled but no PrmService endpoint is configured")
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = make_channel(endpoint, token=self._token, tls_ca_file=self._tls_ca_file)
            self._channels[endpoint] = channel
        timeout_s = spec.timeout_s or None
        return PrmStepJudge(
            PrmClient(channel, timeout_s=timeout_s or 300.0),
            episode_id=episode_id,
            votes=spec.m,
            seed=spec.seed,
            timeout_s=timeout_s,
        )

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
