"""The agent's `StepJudge` over PrmService, and the factory the agent service builds them with.

The agent service calls its `judge_factory` once per PRM-enabled episode with the episode's
`PrmSpec` and id; `PrmJudgeFactory` is that factory and keeps one channel per PRM endpoint.
Each episode gets a `PrmStepJudge`, which the episode calls once per executed turn (format-error
turns it marks NOT_JUDGED itself).

The judge keeps the episode's own step history (command, exit code, ends of the output) from the
turns it is given, in order, and records every turn index it never saw before the current one as
a format error, so the history the PRM model reads matches the episode turn for turn. Seeds are
derived by the PRM service from (base seed, episode, step, vote); the episode key is the agent's
episode id, else a random id per episode, which still keeps the episodes of a group from sharing
seeds.

    factory = PrmJudgeFactory(token=prm_token, default_endpoint="head:18092")
    AgentServer(settings, judge_factory=factory)   # ... and `await factory.close()` at shutdown
"""

from __future__ import annotations

import uuid

import grpc

from swerl.agent.judging.steps import PrmSpec, StepScore, StepScoreState, TurnToJudge
from swerl.chassis.client import make_channel
from swerl.prm.client import DEFAULT_TIMEOUT_S, PrmClient
from swerl.prm.prompt import CurrentStep, HistoryStep, StepToJudge
from swerl.prm.votes import JudgeState, Verdict

# The judge keeps this much of each end of an earlier turn's output; the service cuts further.
HISTORY_OUTPUT_END_CHARS = 2000

STEP_STATE_OF_JUDGE_STATE: dict[JudgeState, StepScoreState] = {
    JudgeState.SCORED: StepScoreState.SCORED,
    JudgeState.NO_VALID_VOTES: StepScoreState.NO_VALID_VOTES,
    JudgeState.FAILED: StepScoreState.FAILED,
}


def step_score_of(turn_index: int, verdict: Verdict) -> StepScore:
    """A PRM verdict as the episode's score of that turn (a score only when SCORED)."""
    state = STEP_STATE_OF_JUDGE_STATE[verdict.state]
    return StepScore(
        turn_index=turn_index,
        state=state,
        score=verdict.score if state is StepScoreState.SCORED else 0.0,
        valid_votes=verdict.valid_votes,
    )


def _ends(output: str) -> tuple[str, str]:
    """Head and tail of an output for the history; all of it in the head when it is short."""
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

    async def judge(self, turn: TurnToJudge) -> StepScore:
        """The score of one executed turn; never raises for PRM trouble (it comes back as
        FAILED)."""
        index = turn.turn_index
        # Taken before the first await, so concurrent judgments see the turns before them.
        history = self._history_before(index)
        head, tail = _ends(turn.output)
        self._seen[index] = HistoryStep(turn.action, turn.exit_code, head, tail)
        verdict = await self._client.judge_step(
            StepToJudge(
                episode_id=self._episode_id,
                step_index=index,
                issue=turn.issue,
                history=history,
                step=CurrentStep(turn.response, turn.action, turn.exit_code, turn.output),
            ),
            votes=self._votes,
            seed=self._seed,
            timeout_s=self._timeout_s,
        )
        return step_score_of(index, verdict)


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

    def __call__(self, spec: PrmSpec, episode_id: str | None = None) -> PrmStepJudge:
        endpoint = spec.endpoint or self._default_endpoint
        if not endpoint:
            raise ValueError("PRM is enabled but no PrmService endpoint is configured")
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = make_channel(endpoint, token=self._token, tls_ca_file=self._tls_ca_file)
            self._channels[endpoint] = channel
        timeout_s = spec.timeout_s or None
        return PrmStepJudge(
            PrmClient(channel, timeout_s=timeout_s or DEFAULT_TIMEOUT_S),
            episode_id=episode_id,
            votes=spec.m,
            seed=spec.seed,
            timeout_s=timeout_s,
        )

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
