"""The agent's judge factory and per-episode judge, against the real PRM service."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from prm_testkit import ISSUE, TOKEN

from swerl.agent.v1 import agent_pb2 as apb
from swerl.prm.agent_judge import PrmJudgeFactory
from swerl.prm.scripted import Rule, verdict
from swerl.prm.votes import vote_seed


@dataclass(frozen=True)
class Spec:
    endpoint: str = ""
    m: int = 2
    seed: int = 9
    timeout_s: float = 20.0


@dataclass(frozen=True)
class Step:
    turn_index: int
    action: str
    issue: str = ISSUE
    exit_code: int = 0
    output: str = "ok"
    episode_id: str = "agent-ep-1"

    @property
    def response(self) -> str:
        return f"RESP-{self.turn_index}\n```bash\n{self.action}\n```"


async def test_turns_judged_concurrently_see_the_turns_before_them_with_gaps_as_format_errors(
    scripted, prm
):
    judge = await scripted(rules=[Rule("RESP-0", [verdict(-1)])], default=[verdict(1)])
    running = await prm(judge.url)
    factory = PrmJudgeFactory(token=TOKEN, default_endpoint=running.address)
    try:
        episode_judge = factory(Spec())
        # Scheduled in turn order, as the agent does; turn 1 was a format error.
        results = await asyncio.gather(
            episode_judge.judge(Step(0, "ls first")),
            episode_judge.judge(Step(2, "cat second")),
        )
    finally:
        await factory.close()

    assert results == [
        (apb.STEP_SCORE_STATE_SCORED, -1.0, 2),
        (apb.STEP_SCORE_STATE_SCORED, 1.0, 2),
    ]
    second = next(r.prompt_text for r in judge.requests if "RESP-2" in r.prompt_text)
    assert "Step 0: $ ls first" in second
    assert "Step 1: (format error" in second
    assert {r.seed for r in judge.requests} == {
        vote_seed(9, "agent-ep-1", turn, vote) for turn in (0, 2) for vote in range(2)
    }


async def test_an_unreachable_prm_service_scores_the_turn_failed(unused_tcp_port):
    factory = PrmJudgeFactory(token=TOKEN)
    try:
        judge = factory(Spec(endpoint=f"127.0.0.1:{unused_tcp_port}", timeout_s=1.0))
        state, score, votes = await judge.judge(Step(0, "ls"))
    finally:
        await factory.close()

    assert (state, score, votes) == (apb.STEP_SCORE_STATE_FAILED, 0.0, 0)


def test_prm_without_any_endpoint_is_refused():
    with pytest.raises(ValueError, match="no PrmService endpoint"):
        PrmJudgeFactory()(Spec())


async def test_episodes_without_an_id_still_get_seeds_of_their_own(scripted, prm):
    judge = await scripted()
    running = await prm(judge.url)
    factory = PrmJudgeFactory(token=TOKEN, default_endpoint=running.address)

    @dataclass(frozen=True)
    class AnonymousStep(Step):
        episode_id: str = ""

    try:
        for _ in range(2):  # two episodes of one group: same spec, same turn
            await factory(Spec(m=1)).judge(AnonymousStep(0, "ls"))
    finally:
        await factory.close()

    assert len({r.seed for r in judge.requests}) == 2
