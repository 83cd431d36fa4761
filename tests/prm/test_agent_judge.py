"""The agent's judge factory and per-episode judge, against the real PRM service."""

from __future__ import annotations

import asyncio

import pytest
from testkit.prm import ISSUE, TOKEN

from swerl.agent.judging.prm_client import PrmJudgeFactory
from swerl.agent.judging.steps import StepScore, StepScoreState, TurnToJudge
from swerl.agent.loop.episode import PrmSpec
from swerl.devservers.scripted_prm import Rule, verdict
from swerl.prm.votes import vote_seed


def spec(endpoint: str = "", m: int = 2, timeout_s: float = 20.0) -> PrmSpec:
    return PrmSpec(enabled=True, endpoint=endpoint, m=m, seed=9, timeout_s=timeout_s)


def turn(index: int, action: str) -> TurnToJudge:
    return TurnToJudge(
        turn_index=index,
        issue=ISSUE,
        response=f"RESP-{index}\n```bash\n{action}\n```",
        action=action,
        exit_code=0,
        output="ok",
    )


async def test_turns_judged_concurrently_see_the_turns_before_them_with_gaps_as_format_errors(
    scripted, prm
):
    judge = await scripted(rules=[Rule("RESP-0", [verdict(-1)])], default=[verdict(1)])
    running = await prm(judge.url)
    factory = PrmJudgeFactory(token=TOKEN, default_endpoint=running.address)
    try:
        episode_judge = factory(spec(), "agent-ep-1")
        # Scheduled in turn order, as the agent does; turn 1 was a format error.
        results = await asyncio.gather(
            episode_judge.judge(turn(0, "ls first")),
            episode_judge.judge(turn(2, "cat second")),
        )
    finally:
        await factory.close()

    assert results == [
        StepScore(0, StepScoreState.SCORED, -1.0, 2),
        StepScore(2, StepScoreState.SCORED, 1.0, 2),
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
        judge = factory(spec(endpoint=f"127.0.0.1:{unused_tcp_port}", timeout_s=1.0))
        score = await judge.judge(turn(0, "ls"))
    finally:
        await factory.close()

    assert score == StepScore(0, StepScoreState.FAILED, 0.0, 0)


def test_prm_without_any_endpoint_is_refused():
    with pytest.raises(ValueError, match="no PrmService endpoint"):
        PrmJudgeFactory()(spec())


async def test_episodes_without_an_id_still_get_seeds_of_their_own(scripted, prm):
    judge = await scripted()
    running = await prm(judge.url)
    factory = PrmJudgeFactory(token=TOKEN, default_endpoint=running.address)

    try:
        for _ in range(2):  # two episodes of one group: same spec, same turn
            await factory(spec(m=1)).judge(turn(0, "ls"))
    finally:
        await factory.close()

    assert len({r.seed for r in judge.requests}) == 2
