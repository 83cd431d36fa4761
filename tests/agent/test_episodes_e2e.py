"""End to end on the real dockerd: pool + exec node + agent service + replay policy (Qwen3
tokenizer) + EvaluateService. Every bundled task resolves; wrong fixes and garbage do not."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from testkit.agent import (
    agent_stack,
    bundled_tasks,
    check_record,
    result_of,
    run_to_result,
    sandboxes_left,
    start_for,
)

from swerl.agent.judging.steps import StepScore, StepScoreState, TurnToJudge
from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import ReplayPolicyServer, scripts_for_tasks

pytestmark = pytest.mark.usefixtures("base_image")


async def test_every_bundled_task_resolves_with_reward_plus_one(tmp_path: Path) -> None:
    tasks = bundled_tasks()
    replay = ReplayPolicyServer(scripts_for_tasks(tasks, "gold"))
    url = await replay.start()
    try:
        async with agent_stack(tokenizer_processes=2) as env:
            runs = await asyncio.gather(
                *(
                    run_to_result(
                        env.stub,
                        start_for(
                            t,
                            url,
                            f"gold-{i}",
                            artifact_dir=str(tmp_path),
                            dynamic_history=i % 2 == 1,
                        ),
                    )
                    for i, t in enumerate(tasks)
                )
            )
    finally:
        await replay.stop()
    for i, (task, messages) in enumerate(zip(tasks, runs, strict=True)):
        result = result_of(messages)
        assert result.status == pb.EPISODE_STATUS_SUBMITTED, (task.instance_id, result)
        assert result.HasField("reward") and result.reward == 1.0, result.report
        assert b"diff --git" in result.patch
        kinds = [m.WhichOneof("kind") for m in messages]
        assert kinds[0] == "started" and kinds.count("turn") == 4 and "evaluation" in kinds
        if i % 2 == 1:
            assert len(result.turns) == 4 and not result.HasField("trajectory")
            for record in result.turns:
                check_record(record, replay)
                assert set(record.loss_mask) == {1} and record.reward == 1.0
            # Without trimming each turn's prompt extends the previous prompt and response.
            for before, after in zip(result.turns, result.turns[1:], strict=False):
                seen = list(before.prompt_ids) + list(before.response_ids)
                assert list(after.prompt_ids[: len(seen)]) == seen
        else:
            check_record(result.trajectory, replay)
            assert result.trajectory.reward == 1.0
        for key in (
            "turns",
            "tool_calls",
            "model_query_time_sum",
            "env_execution_time_sum",
            "eval_time",
            "agent_run_time",
            "total_time",
            "overhead_time",
            "time_per_turn",
            "model_query_time_avg",
            "env_execution_time_avg",
            "model_time_ratio",
            "env_time_ratio",
            "eval_time_ratio",
        ):
            assert key in result.metrics, key
        artifacts = Path(result.artifact_dir)
        traj = json.loads((artifacts / "traj.json").read_text())
        assert traj["info"]["exit_status"] == "SUBMITTED"
        assert (artifacts / "patch.diff").read_bytes() == result.patch
        assert json.loads((artifacts / "meta.json").read_text())["reward"] == 1.0
    assert sandboxes_left() == []


async def test_a_wrong_fix_gets_reward_minus_one() -> None:
    tasks = [t for t in bundled_tasks() if t.wrong_patch][:1] + bundled_tasks()[:1]
    replay = ReplayPolicyServer(scripts_for_tasks(tasks, "wrong"))
    url = await replay.start()
    try:
        async with agent_stack() as env:
            for i, task in enumerate(tasks):
                result = result_of(await run_to_result(env.stub, start_for(task, url, f"w{i}")))
                assert result.status == pb.EPISODE_STATUS_SUBMITTED
                assert result.reward == -1.0, result.report
                check_record(result.trajectory, replay)
    finally:
        await replay.stop()
    assert sandboxes_left() == []


async def test_garbage_policy_ends_in_format_errors_and_limit_turns() -> None:
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(garbage=True)
    url = await replay.start()
    try:
        async with agent_stack() as env:
            messages = await run_to_result(env.stub, start_for(task, url, "garbage", max_turns=5))
    finally:
        await replay.stop()
    result = result_of(messages)
    turns = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    assert result.status == pb.EPISODE_STATUS_LIMIT_TURNS
    assert len(turns) == 5 and all(t.format_error for t in turns)
    assert result.reward == -1.0  # graded: nothing changed, so unresolved
    check_record(result.trajectory, replay)
    assert result.metrics["tool_calls"] == 0
    assert sandboxes_left() == []


async def test_dynamic_history_records_are_the_exact_ids_sent_even_when_trimmed() -> None:
    task = bundled_tasks()[0]
    key = next(iter(scripts_for_tasks([task])))
    looks = [f"Looking.\n\n```bash\nseq {i} {i + 150}\n```" for i in range(12)]
    replay = ReplayPolicyServer({key: looks}, keep_requests=True)
    url = await replay.start()
    start = start_for(task, url, "trim", max_turns=12, dynamic_history=True)
    start.limits.max_context_tokens = 4096
    start.limits.max_new_tokens = 512
    try:
        async with agent_stack() as env:
            messages = await run_to_result(env.stub, start)
    finally:
        await replay.stop()
    result = result_of(messages)
    turns = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    assert result.status == pb.EPISODE_STATUS_LIMIT_TURNS
    assert any(t.context_trimmed for t in turns)
    seen = replay.stats.requests_seen
    assert len(result.turns) == len(seen) == 12
    for record, (sent, answered) in zip(result.turns, seen, strict=True):
        check_record(record, replay)
        assert list(record.prompt_ids) == sent
        assert list(record.response_ids) == answered
        assert len(record.prompt_ids) + 512 <= 4096
    assert sandboxes_left() == []


async def test_a_trimmed_whole_trajectory_is_one_record_per_chain_of_what_was_sent() -> None:
    task = bundled_tasks()[0]
    key = next(iter(scripts_for_tasks([task])))
    looks = [f"Looking.\n\n```bash\nseq {i} {i + 150}\n```" for i in range(12)]
    replay = ReplayPolicyServer({key: looks}, keep_requests=True)
    url = await replay.start()
    start = start_for(task, url, "chains", max_turns=12)
    start.limits.max_context_tokens = 4096
    start.limits.max_new_tokens = 512
    try:
        async with agent_stack() as env:
            messages = await run_to_result(env.stub, start)
    finally:
        await replay.stop()
    result = result_of(messages)
    trims = [m.turn.context_trimmed for m in messages if m.WhichOneof("kind") == "turn"]
    assert result.status == pb.EPISODE_STATUS_LIMIT_TURNS and any(trims)
    assert not result.HasField("trajectory") and len(result.chains) == 1 + sum(trims)
    seen = replay.stats.requests_seen
    turn = 0
    for chain in result.chains:
        check_record(chain, replay)
        assert chain.reward == result.reward
        # The chain starts with a prompt the policy was sent, and every token after it is the
        # next response (mask 1) or what the agent appended before the next call (mask 0).
        assert list(chain.prompt_ids) == seen[turn][0]
        tokens = list(chain.prompt_ids) + list(chain.response_ids)
        mask = [0] * len(chain.prompt_ids) + list(chain.loss_mask)
        first = turn
        while turn < len(seen) and tokens[: len(seen[turn][0])] == seen[turn][0]:
            sent, answered = seen[turn]
            if len(sent) >= len(tokens):
                break
            assert tokens[len(sent) : len(sent) + len(answered)] == answered
            assert mask[len(sent) : len(sent) + len(answered)] == [1] * len(answered)
            turn += 1
        assert turn > first
        assert len(tokens) == len(seen[turn - 1][0]) + len(seen[turn - 1][1])
        assert sum(mask) == sum(len(seen[k][1]) for k in range(first, turn))
        assert len(tokens) <= 4096, "a chain never outgrows the context budget"
    assert turn == len(seen) == 12
    assert sandboxes_left() == []


class _FakeJudge:
    """A StepJudge behind the agent's Protocol: score = 0.1 x (turn index + 1)."""

    def __init__(self) -> None:
        self.judged: list[int] = []

    async def judge(self, turn: TurnToJudge) -> StepScore:
        self.judged.append(turn.turn_index)
        return StepScore(turn.turn_index, StepScoreState.SCORED, 0.1 * (turn.turn_index + 1), 3)


async def test_prm_scores_are_keyed_by_turn_and_format_errors_are_not_judged() -> None:
    task = bundled_tasks()[0]
    key, script = next(iter(scripts_for_tasks([task]).items()))
    script = [script[0], "I forgot the block this time.", *script[1:]]
    judge = _FakeJudge()
    replay = ReplayPolicyServer({key: script})
    url = await replay.start()
    results = []
    try:
        async with agent_stack(judge_factory=lambda spec, episode_id: judge) as env:
            for dynamic in (False, True):
                start = start_for(task, url, f"prm-{dynamic}", dynamic_history=dynamic)
                start.prm.enabled, start.prm.coef, start.prm.endpoint = True, 0.5, "unused:1"
                results.append(result_of(await run_to_result(env.stub, start)))
    finally:
        await replay.stop()
    for result in results:
        assert result.status == pb.EPISODE_STATUS_SUBMITTED and result.reward == 1.0
        states = [(s.turn_index, s.state) for s in result.step_scores]
        assert states == [
            (0, pb.STEP_SCORE_STATE_SCORED),
            (1, pb.STEP_SCORE_STATE_NOT_JUDGED),
            (2, pb.STEP_SCORE_STATE_SCORED),
            (3, pb.STEP_SCORE_STATE_SCORED),
            (4, pb.STEP_SCORE_STATE_SCORED),
        ]
        assert abs(result.step_scores[2].score - 0.3) < 1e-9
    whole, per_turn = results
    assert abs(whole.trajectory.reward - (1.0 + 0.5 * (0.1 + 0.3 + 0.4 + 0.5) / 4)) < 1e-9
    assert [round(r.reward, 6) for r in per_turn.turns] == [1.05, 1.0, 1.15, 1.2, 1.25]
    assert sandboxes_left() == []


class _TroubledJudge:
    """Turn 1's judgment raises, turn 2's outlives the PRM timeout, the others score 1."""

    def __init__(self) -> None:
        self.finished: list[int] = []

    async def judge(self, turn: TurnToJudge) -> StepScore:
        if turn.turn_index == 1:
            raise RuntimeError("judge exploded")
        if turn.turn_index == 2:
            await asyncio.sleep(60)
        self.finished.append(turn.turn_index)
        return StepScore(turn.turn_index, StepScoreState.SCORED, 1.0, 1)


async def test_a_judge_that_raises_or_hangs_fails_only_its_own_turn() -> None:
    task = bundled_tasks()[0]
    key, script = next(iter(scripts_for_tasks([task]).items()))
    judge = _TroubledJudge()
    replay = ReplayPolicyServer({key: script})
    url = await replay.start()
    try:
        async with agent_stack(judge_factory=lambda spec, episode_id: judge) as env:
            start = start_for(task, url, "prm-troubled")
            start.prm.enabled, start.prm.coef, start.prm.endpoint = True, 0.5, "unused:1"
            start.prm.timeout.seconds = 1
            messages = await run_to_result(env.stub, start)
    finally:
        await replay.stop()
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_SUBMITTED and result.reward == 1.0
    states = {s.turn_index: s.state for s in result.step_scores}
    assert len(states) == len(script)
    assert states[1] == states[2] == pb.STEP_SCORE_STATE_FAILED
    others = [s for s in result.step_scores if s.turn_index not in (1, 2)]
    assert all(s.state == pb.STEP_SCORE_STATE_SCORED and s.score == 1.0 for s in others)
    # The failed turns take no part in the mean: every usable score is 1.
    assert abs(result.trajectory.reward - 1.5) < 1e-9
    assert sandboxes_left() == []


class _HangingJudge:
    """Every judgment outlives the episode."""

    def __init__(self) -> None:
        self.started = 0

    async def judge(self, turn: TurnToJudge) -> StepScore:
        self.started += 1
        await asyncio.sleep(3600)
        raise AssertionError("never reached")


async def test_cancelling_an_episode_abandons_its_running_judgments() -> None:
    task = bundled_tasks()[0]
    judge = _HangingJudge()
    replay = ReplayPolicyServer(scripts_for_tasks([task]))
    url = await replay.start()
    try:
        async with agent_stack(judge_factory=lambda spec, episode_id: judge) as env:
            start = start_for(task, url, "prm-cancelled")
            start.prm.enabled, start.prm.coef, start.prm.endpoint = True, 0.5, "unused:1"
            start.prm.timeout.seconds = 600
            call = env.stub.RunEpisode(timeout=120)
            await call.write(pb.RunEpisodeRequest(start=start))
            messages = []
            async for message in call:
                messages.append(message)
                if message.WhichOneof("kind") == "evaluation":
                    # Graded: now the episode only waits for its judgments.
                    sent = time.monotonic()
                    await call.write(pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason="t")))
            waited_s = time.monotonic() - sent
    finally:
        await replay.stop()
    result = result_of(messages)
    assert result.status == pb.EPISODE_STATUS_CANCELLED and not result.HasField("reward")
    assert judge.started == 4 and waited_s < 5
    assert not any(m.WhichOneof("kind") == "prm_score" for m in messages)
    assert sandboxes_left() == []
