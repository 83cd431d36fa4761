"""Branching episodes (EpisodeOptions.branch) end to end on the real dockerd: pool + exec node
(ForkLease/ForkSandbox) + agent service + replay policy with the real Qwen3 tokenizer +
EvaluateService. The trunk's tokens are generated once and begin every branch byte for byte;
branches sample with distinct seeds, are graded one by one, fail and cancel as the contract says,
and leave no sandbox, lease or fork image behind."""

from __future__ import annotations

import asyncio
import itertools
import time

import docker
import pytest
from testkit.agent import (
    agent_stack,
    bundled_tasks,
    check_record,
    run_to_result,
    sandboxes_left,
    start_for,
)

from swerl.agent.judging.steps import StepScore, StepScoreState, TurnToJudge
from swerl.agent.v1 import agent_pb2 as pb
from swerl.devservers.replay import (
    ReplayPolicyServer,
    gold_script,
    patch_turn,
    script_key,
    scripts_for_tasks,
    submit_turn,
)
from swerl.exec.v1 import evaluate_pb2
from swerl.pool.client import PoolClient

pytestmark = pytest.mark.usefixtures("base_image")


def _fork_images_of(node_ids: list[str]) -> list[str]:
    client = docker.from_env()
    try:
        # One listing with the labels (images.list inspects each image it lists, and fails
        # when a node, this stack's or another's on the same dockerd, removes one meanwhile).
        images = client.api.images(filters={"label": "swerl.checkpoint_id"})
        return [i["Id"] for i in images if (i.get("Labels") or {}).get("swerl.node") in node_ids]
    finally:
        client.close()


async def _nothing_left(env, timeout_s: float = 30.0) -> None:
    """No sandbox container, active lease or fork image of this stack (the node removes fork
    images in the background once nothing uses them, hence the wait)."""
    node_ids = [n.settings.node_id for n in env.stack.nodes]
    pool = PoolClient(env.stack.pool_address, token=env.stack.token)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            active = [x.lease_id for x in await pool.list_leases() if x.state == 2]
            images = await asyncio.to_thread(_fork_images_of, node_ids)
            containers = [c for n in node_ids for c in sandboxes_left(n)]
            if not (active or images or containers):
                return
            assert time.monotonic() < deadline, (active, images, containers)
            await asyncio.sleep(0.3)
    finally:
        await pool.close()


def _runs(container: str, needle: str) -> bool:
    client = docker.from_env()
    try:
        rows = client.containers.get(container).top(ps_args="-eo pid,args").get("Processes") or []
        return any(needle in " ".join(row) for row in rows)
    except docker.errors.APIError:  # gone, or not running (a sandbox being destroyed)
        return False
    finally:
        client.close()


async def _until_running(sandbox_id: str, needle: str) -> None:
    """Waits until a process of the sandbox's command line `needle` runs in its container: the
    command has started (and so the sandbox's shell start-up is over)."""
    deadline = time.monotonic() + 120
    while not await asyncio.to_thread(_runs, f"swerl-{sandbox_id}", needle):
        assert time.monotonic() < deadline, f"{needle!r} never ran in {sandbox_id}"
        await asyncio.sleep(0.1)


async def _until_n_run(pool: PoolClient, n: int, needle: str) -> None:
    """Waits until `n` active leases' sandboxes run `needle` (each branch is in that command).
    A release before then would come while a fork's shell is still starting."""
    deadline = time.monotonic() + 120
    while True:
        sandboxes = [x.sandbox_id for x in await pool.list_leases() if x.state == 2]
        running = [s for s in sandboxes if await asyncio.to_thread(_runs, f"swerl-{s}", needle)]
        if len(running) == n:
            return
        assert time.monotonic() < deadline, f"never {n} sandboxes running {needle!r}"
        await asyncio.sleep(0.1)


async def _until_active(pool: PoolClient, n: int, not_of: str = "") -> list[str]:
    """The ids of the active leases once there are `n` and `not_of` is not one of them."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ids = [x.lease_id for x in await pool.list_leases() if x.state == 2]
        if len(ids) == n and not_of not in ids:
            return ids
        await asyncio.sleep(0.1)
    raise AssertionError(f"never {n} active leases")


def _branched(start: pb.EpisodeStart, at_turn: int, count: int) -> pb.EpisodeStart:
    start.options.branch.at_turn, start.options.branch.count = at_turn, count
    return start


def _results(messages: list[pb.RunEpisodeResponse]) -> list[pb.EpisodeResult]:
    return [m.result for m in messages if m.WhichOneof("kind") == "result"]


def _bash(command: str) -> str:
    return f"Running it.\n\n```bash\n{command}\n```"


async def test_eight_branches_at_turn_3_begin_with_the_trunks_tokens_and_are_all_graded():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(scripts_for_tasks([task], "gold"), keep_requests=True)
    url = await replay.start()
    try:
        # The trunk's sandbox and 8 forks are on the node together for a moment.
        async with agent_stack(max_sandboxes=9) as env:
            start = _branched(start_for(task, url, "branch-8"), at_turn=3, count=8)
            start.policy.sampling_params.update({"sampling_seed": 1000})
            messages = await run_to_result(env.stub, start)
            await _nothing_left(env)
    finally:
        await replay.stop()
    kinds = [m.WhichOneof("kind") for m in messages]
    assert kinds[0] == "started" and kinds[-8:] == ["result"] * 8, kinds
    assert "evaluation" not in kinds  # each branch's report is in its result
    turns = [m.turn for m in messages if m.WhichOneof("kind") == "turn"]
    trunk = [t for t in turns if not t.HasField("branch")]
    assert [t.index for t in trunk] == [0, 1, 2]
    assert sorted((t.branch, t.index) for t in turns if t.HasField("branch")) == [
        (b, 3) for b in range(8)
    ]
    # The trunk's 3 turns were generated once: 3 + 8 policy calls in all.
    assert replay.stats.requests == 3 + 8
    fourth = [ids for ids, _ in replay.stats.requests_seen[3:]]
    assert all(ids == fourth[0] for ids in fourth)  # each branch's 4th prompt: the trunk
    trunk_tokens = fourth[0]
    results = _results(messages)
    assert sorted(r.branch for r in results) == list(range(8))
    seeds = {r.branch: r.sampling_seed for r in results}
    assert seeds == {b: 1000 + 1 + b for b in range(8)}
    # The seeds reached the policy: the trunk's calls with the episode's, each branch's own.
    call_seeds = [c.sampling_seed for c in replay.stats.calls]
    assert call_seeds[:3] == [1000] * 3 and sorted(call_seeds[3:]) == sorted(seeds.values())
    first_prefix = None
    for result in results:
        assert result.episode_id == "branch-8"
        assert result.status == pb.EPISODE_STATUS_SUBMITTED, result
        assert result.report.status == evaluate_pb2.EVALUATION_STATUS_RESOLVED_FULL
        assert result.HasField("report") and result.reward == 1.0, result.report
        record = result.trajectory
        check_record(record, replay)
        sequence = list(record.prompt_ids) + list(record.response_ids)
        assert sequence[: len(trunk_tokens)] == trunk_tokens
        n_prefix = len(trunk_tokens) - len(record.prompt_ids)
        prefix = (
            list(record.loss_mask[:n_prefix]),
            [round(x, 6) for x in record.logprobs[:n_prefix]],
        )
        first_prefix = first_prefix or prefix
        assert prefix == first_prefix  # masks and logprobs of the trunk's turns too
        assert result.metrics["turns"] == 4.0 and result.metrics["tool_calls"] == 4.0


class _Judge:
    """Scores each turn index/10, slowly for the trunk's turns (so those judgments are still
    pending at the fork and must reach every branch)."""

    async def judge(self, turn: TurnToJudge) -> StepScore:
        if turn.turn_index < 2:
            await asyncio.sleep(1.5)
        return StepScore(turn.turn_index, StepScoreState.SCORED, turn.turn_index / 10, 1)


async def test_a_branch_whose_lease_is_lost_ends_infra_error_alone_and_the_others_go_on():
    task = bundled_tasks()[0]
    script = [
        _bash("git status --short && ls"),
        patch_turn(task.gold_patch, "Applying the fix."),
        _bash("sleep 6; ls"),
        submit_turn(),
    ]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): script})
    url = await replay.start()
    judge = _Judge()
    try:
        async with agent_stack(max_sandboxes=6, judge_factory=lambda s, e: judge) as env:
            start = _branched(
                start_for(task, url, "branch-lost", dynamic_history=True), at_turn=2, count=3
            )
            start.prm.enabled, start.prm.coef, start.prm.endpoint = True, 0.5, "unused:1"
            call = env.stub.RunEpisode(timeout=300)
            await call.write(pb.RunEpisodeRequest(start=start))
            started = (await call.read()).started
            pool = PoolClient(env.stack.pool_address, token=env.stack.token)
            try:
                # Once the trunk's lease is gone, the active ones are the 3 branches'. Wait
                # until one is in its 6-second command, then release it behind the agent's back.
                active = await _until_active(pool, 3, not_of=started.lease_id)
                lost = next(x for x in await pool.list_leases() if x.lease_id == active[0])
                await _until_running(lost.sandbox_id, "sleep 6")
                await pool.release(lost.lease_id)
            finally:
                await pool.close()
            messages = [m async for m in call]
            await _nothing_left(env)
    finally:
        await replay.stop()
    results = _results(messages)
    assert sorted(r.branch for r in results) == [0, 1, 2]
    lost = [r for r in results if r.status == pb.EPISODE_STATUS_INFRA_ERROR]
    assert len(lost) == 1, [(r.status, r.error_reason) for r in results]
    assert lost[0].error_reason in ("LEASE_LOST", "SANDBOX_UNAVAILABLE"), lost[0]
    assert not lost[0].HasField("reward")
    graded = [r for r in results if r is not lost[0]]
    for result in graded:
        assert result.status == pb.EPISODE_STATUS_SUBMITTED and result.reward == 1.0, result
        # The trunk's judgments (pending at the fork) are in every branch, with its own after.
        assert [(s.turn_index, round(s.score, 6)) for s in result.step_scores] == [
            (i, i / 10) for i in range(4)
        ]
        assert not any(s.HasField("branch") for s in result.step_scores[:2])
        assert all(s.branch == result.branch for s in result.step_scores[2:])
        assert len(result.turns) == 4
        for record in result.turns:
            check_record(record, replay)
        assert [round(r.reward, 6) for r in result.turns] == [1.0, 1.05, 1.1, 1.15]
    for a, b in itertools.pairwise(graded):  # dynamic history: trunk turns equal
        assert a.turns[:2] == b.turns[:2]
    scores = [m.prm_score for m in messages if m.WhichOneof("kind") == "prm_score"]
    assert sorted(s.turn_index for s in scores if not s.HasField("branch")) == [0, 1]


async def test_cancel_stops_every_branch_and_leaves_no_sandbox_or_fork_image():
    task = bundled_tasks()[0]
    script = [_bash("ls"), _bash("echo trunk > /tmp/t"), _bash("sleep 60"), submit_turn()]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): script})
    url = await replay.start()
    try:
        async with agent_stack(max_sandboxes=6) as env:
            start = _branched(start_for(task, url, "branch-cancel"), at_turn=2, count=3)
            call = env.stub.RunEpisode(timeout=300)
            await call.write(pb.RunEpisodeRequest(start=start))
            pool = PoolClient(env.stack.pool_address, token=env.stack.token)
            try:
                await _until_n_run(pool, 3, "sleep 60")  # the branches are in their `sleep 60`
            finally:
                await pool.close()
            cancelled_at = time.monotonic()
            await call.write(pb.RunEpisodeRequest(cancel=pb.EpisodeCancel(reason="test")))
            messages = [m async for m in call]
            assert time.monotonic() - cancelled_at < 5.0
            await _nothing_left(env)
    finally:
        await replay.stop()
    results = _results(messages)
    assert sorted(r.branch for r in results) == [0, 1, 2]
    for result in results:
        assert result.status == pb.EPISODE_STATUS_CANCELLED, result
        assert not result.HasField("reward") and not result.HasField("report")
        # The partial trajectory: the trunk's 2 turns and the branch's cut-off third.
        assert result.metrics["turns"] == 3.0
        check_record(result.trajectory, replay)


async def test_a_dropped_call_during_the_branches_releases_every_sandbox():
    task = bundled_tasks()[0]
    script = [_bash("ls"), _bash("sleep 60"), submit_turn()]
    replay = ReplayPolicyServer({script_key(task.instance["problem_statement"]): script})
    url = await replay.start()
    try:
        async with agent_stack(max_sandboxes=4) as env:
            start = _branched(start_for(task, url, "branch-dropped"), at_turn=1, count=2)
            call = env.stub.RunEpisode(timeout=300)
            await call.write(pb.RunEpisodeRequest(start=start))
            pool = PoolClient(env.stack.pool_address, token=env.stack.token)
            try:
                await _until_n_run(pool, 2, "sleep 60")
            finally:
                await pool.close()
            call.cancel()  # no `cancel` message: the caller went away
            await _nothing_left(env)
            assert env.agent.runner.running == {}
    finally:
        await replay.stop()


async def test_a_trunk_that_ends_before_the_fork_returns_its_one_result_unbranched():
    task = bundled_tasks()[0]
    key = script_key(task.instance["problem_statement"])
    replay = ReplayPolicyServer({key: gold_script(task.gold_patch)})  # submits at turn 3
    url = await replay.start()
    try:
        async with agent_stack() as env:
            start = _branched(start_for(task, url, "branch-late"), at_turn=6, count=2)
            messages = await run_to_result(env.stub, start)
            await _nothing_left(env)
    finally:
        await replay.stop()
    results = _results(messages)
    assert len(results) == 1 and not results[0].HasField("branch")
    assert results[0].status == pb.EPISODE_STATUS_SUBMITTED and results[0].reward == 1.0
    assert results[0].sampling_seed == 0
    assert not any(m.turn.HasField("branch") for m in messages if m.WhichOneof("kind") == "turn")


async def test_a_fork_without_room_on_the_node_ends_the_trunk_infra_error_fork_unavailable():
    task = bundled_tasks()[0]
    replay = ReplayPolicyServer(scripts_for_tasks([task], "gold"))
    url = await replay.start()
    try:
        # Room for the trunk and one more: 2 branches never fit on its node.
        async with agent_stack(max_sandboxes=2, lease_wait_s=1.0) as env:
            start = _branched(start_for(task, url, "branch-full"), at_turn=1, count=2)
            messages = await run_to_result(env.stub, start)
            await _nothing_left(env)
    finally:
        await replay.stop()
    results = _results(messages)
    assert len(results) == 1 and not results[0].HasField("branch"), results
    result = results[0]
    assert result.status == pb.EPISODE_STATUS_INFRA_ERROR
    assert result.error_reason == "FORK_UNAVAILABLE" and "FORK_NODE_FULL" in result.error_message
    assert not result.HasField("reward") and result.metrics["turns"] == 1.0
