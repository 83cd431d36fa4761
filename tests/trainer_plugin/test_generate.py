"""generate() against a real grpc.aio AgentService playing back canned episodes.

Every returned sample is checked against slime's invariants (slime_standin.check_call_result).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from testkit.playback import (
    PROMPT,
    PlaybackAgent,
    PlaybackServer,
    S,
    Scenario,
    eventually,
    result,
    turns,
)
from testkit.plugin import SAMPLING_PARAMS, make_args, make_sample

from swerl.agent import budget

pytestmark = pytest.mark.usefixtures("fw")


def agent(scenario_for=lambda start: Scenario()) -> PlaybackServer:
    return PlaybackServer(PlaybackAgent(scenario_for))


async def test_whole_trajectory_episode_becomes_one_exact_sample(fw, sampling_params):
    async with agent() as server:
        sample = make_sample()
        out = await fw.generate(make_args([server.address]), sample, sampling_params)

    (got,) = fw.check_call_result(out, per_turn=False)
    ts = turns(3)
    response = [tok for t in ts for tok in t.response + t.observation]
    assert got.tokens == PROMPT + response
    assert got.response_length == len(response)
    assert got.loss_mask == [m for t in ts for m in [1] * 3 + [0] * len(t.observation)]
    expected_logprobs = [lp for t in ts for lp in t.logprobs + [0.0] * len(t.observation)]
    assert got.rollout_log_probs == pytest.approx(expected_logprobs)
    assert got.status is fw.Sample.Status.COMPLETED
    assert got.reward == 1.0 and not got.remove_sample
    assert got.weight_versions == ["7", "7", "7"]
    meta = got.metadata
    assert meta["episode_status"] == "SUBMITTED"
    assert meta["agent_metrics"]["turns"] == 3.0
    assert meta["eval_report"]["status"] == "EVALUATION_STATUS_RESOLVED_FULL"
    assert meta["patch"].startswith("diff --git")
    assert meta["artifact_dir"].startswith("/artifacts/swerl-examples__listutils-14__")
    assert meta["instance"]["instance_id"] == "swerl-examples__listutils-14"
    # The sample slime passed in is untouched; the returned one is a clone.
    assert got is not sample and sample.tokens == [] and sample.reward is None
    assert "episode_id" not in sample.metadata


async def test_dynamic_history_gives_one_sample_per_turn_with_the_exact_context(
    fw, sampling_params
):
    async with agent() as server:
        args = make_args([server.address], dynamic_history=True)
        out = await fw.generate(args, make_sample(), sampling_params)

    samples = fw.check_call_result(out, per_turn=True)
    assert len(samples) == 3
    ts, context = turns(3), list(PROMPT)
    for i, (got, t) in enumerate(zip(samples, ts, strict=True)):
        assert got.tokens == context + t.response, f"turn {i} saw exactly this context"
        assert got.loss_mask == [1, 1, 1]
        assert got.rollout_log_probs == pytest.approx(t.logprobs)
        assert got.metadata["turn_index"] == i
        assert got.reward == 1.0
        context = context + t.response + t.observation
    assert len({s.rollout_id for s in samples}) == 1
    assert len({id(s.metadata) for s in samples}) == 3, "each turn has its own metadata dict"


async def test_start_carries_instance_router_tokenizer_and_a_copy_of_sampling_params(
    fw, sampling_params
):
    async with agent() as server:
        args = make_args([server.address], prm_enabled=True, prm_m=3, prm_coef=0.2)
        await fw.generate(args, make_sample(), sampling_params)
        (start,) = server.agent.starts
        (metadata,) = server.agent.metadata

    assert sampling_params == SAMPLING_PARAMS, "sampling_params must not be mutated"
    assert start.policy.endpoint == "http://127.0.0.1:30000"
    assert start.policy.tokenizer_path == args.hf_checkpoint
    params = dict(start.policy.sampling_params)
    assert params["max_new_tokens"] == 4096 and params["temperature"] == 1.0
    assert list(params["stop_token_ids"]) == [151645] and "stop" not in params
    instance = start.instance
    assert instance.instance_id == "swerl-examples__listutils-14"
    assert list(instance.fail_to_pass) == ["tests/test_chunk.py::test_partial"]
    assert list(instance.pass_to_pass) == ["tests/test_chunk.py::test_even"]
    # No explicit image_name: the SWE-Gym naming rule of the row's data source.
    assert instance.image_name == (
        "docker.io/xingyaoww/sweb.eval.x86_64.swerl-examples_s_listutils-14:latest"
    )
    assert instance.problem_statement == "chunk() drops the last partial chunk"
    assert instance.extra["difficulty"] == "2"
    assert start.limits.max_context_tokens == 16384
    assert start.prm.enabled and start.prm.m == 3 and start.prm.coef == pytest.approx(0.2)
    assert not start.options.dynamic_history
    assert start.options.owner == f"{fw.NAME}/train/group-0"
    assert metadata["x-request-id"] == start.episode_id
    assert start.options.harness == ""  # the agent's default: builtin


async def test_the_harness_setting_reaches_the_start(fw, sampling_params, monkeypatch):
    monkeypatch.setenv("SWERL_PLUGIN_HARNESS", "builtin")
    async with agent() as server:
        await fw.generate(make_args([server.address]), make_sample(), sampling_params)
        (start,) = server.agent.starts
    assert start.options.harness == "builtin"


async def test_explicit_image_name_wins_and_agent_token_is_sent(fw, sampling_params):
    async with agent() as server:
        args = make_args([server.address], agent_token="s3cret")
        sample = make_sample(image_name="swerl-examples/listutils-14:latest")
        await fw.generate(args, sample, sampling_params)
        (start,) = server.agent.starts
        (metadata,) = server.agent.metadata
    assert start.instance.image_name == "swerl-examples/listutils-14:latest"
    assert metadata["authorization"] == "Bearer s3cret"


@pytest.mark.parametrize(
    ("status", "slime_status"),
    [
        (S.EPISODE_STATUS_SUBMITTED, "COMPLETED"),
        (S.EPISODE_STATUS_LIMIT_TURNS, "TRUNCATED"),
        (S.EPISODE_STATUS_LIMIT_CONTEXT, "TRUNCATED"),
        (S.EPISODE_STATUS_LIMIT_TIME, "TRUNCATED"),
        (S.EPISODE_STATUS_HARNESS_FAILED, "COMPLETED"),
        (S.EPISODE_STATUS_HARNESS_TIMEOUT, "TRUNCATED"),
    ],
)
@pytest.mark.parametrize("per_turn", [False, True])
async def test_graded_statuses_map_to_slime_statuses_with_the_outcome_reward(
    fw, sampling_params, status, slime_status, per_turn
):
    reward = 1.0 if status == S.EPISODE_STATUS_SUBMITTED else -1.0
    async with agent(lambda start: Scenario(result=result(start, status, reward=reward))) as srv:
        args = make_args([srv.address], dynamic_history=per_turn)
        out = await fw.generate(args, make_sample(), sampling_params)
    for got in fw.check_call_result(out, per_turn=per_turn):
        assert got.status is getattr(fw.Sample.Status, slime_status)
        assert got.reward == reward and not got.remove_sample
        assert got.metadata["outcome_reward"] == reward


@pytest.mark.parametrize("status", [S.EPISODE_STATUS_CANCELLED, S.EPISODE_STATUS_ABORTED])
@pytest.mark.parametrize("per_turn", [False, True])
async def test_cancelled_and_aborted_episodes_are_aborted_samples_with_reward_zero(
    fw, sampling_params, status, per_turn
):
    answer = lambda start: Scenario(result=result(start, status, n_turns=2, reward=None))  # noqa: E731
    async with agent(answer) as server:
        args = make_args([server.address], dynamic_history=per_turn)
        out = await fw.generate(args, make_sample(), sampling_params)
    samples = fw.check_call_result(out, per_turn=per_turn)
    assert len(samples) == (2 if per_turn else 1)
    for got in samples:
        assert got.status is fw.Sample.Status.ABORTED
        assert got.reward == 0.0
        assert got.metadata["outcome_reward"] is None


@pytest.mark.parametrize("per_turn", [False, True])
async def test_infra_error_becomes_one_placeholder_marked_for_removal(
    fw, sampling_params, per_turn
):
    def answer(start):
        return Scenario(
            result=result(
                start, S.EPISODE_STATUS_INFRA_ERROR, reward=None, error_reason="LEASE_LOST"
            )
        )

    async with agent(answer) as server:
        args = make_args([server.address], dynamic_history=per_turn)
        out = await fw.generate(args, make_sample(), sampling_params)
    (got,) = fw.check_call_result(out, per_turn=per_turn)
    assert got.remove_sample and got.reward == 0.0 and got.loss_mask == [0]
    assert got.status is fw.Sample.Status.FAILED
    assert got.metadata["infra_error"] is True
    assert got.metadata["error_reason"] == "LEASE_LOST"
    assert got.metadata["episode_status"] == "INFRA_ERROR"


async def test_prm_shaped_turn_rewards_are_the_sample_rewards(fw, sampling_params):
    shaping = [0.1, -0.2, 0.3]

    def answer(start):
        return Scenario(result=result(start, reward=1.0, shaping=shaping))

    async with agent(answer) as server:
        args = make_args([server.address], dynamic_history=True, prm_enabled=True)
        out = await fw.generate(args, make_sample(), sampling_params)
    samples = fw.check_call_result(out, per_turn=True)
    assert [s.reward for s in samples] == pytest.approx([1.1, 0.8, 1.3])
    assert all(s.metadata["outcome_reward"] == 1.0 for s in samples)


async def test_evaluation_calls_return_one_sample_per_episode_even_with_dynamic_history(
    fw, sampling_params
):
    async with agent() as server:
        args = make_args([server.address], dynamic_history=True)
        out = await fw.generate(args, make_sample(), sampling_params, evaluation=True)
        (start,) = server.agent.starts
    fw.check_call_result(out, per_turn=False)
    assert not start.options.dynamic_history
    assert start.options.owner == f"{fw.NAME}/eval/eval/sample-0"


async def test_record_breaking_the_token_invariants_becomes_a_placeholder(fw, sampling_params):
    def answer(start):
        bad = result(start)
        del bad.trajectory.loss_mask[-1]
        return Scenario(result=bad)

    async with agent(answer) as server:
        out = await fw.generate(make_args([server.address]), make_sample(), sampling_params)
    (got,) = fw.check_call_result(out, per_turn=False)
    assert got.remove_sample and got.metadata["error_reason"] == "INVALID_TOKEN_RECORD"


async def test_graded_episode_without_reward_becomes_a_placeholder(fw, sampling_params):
    async with agent(lambda start: Scenario(result=result(start, reward=None))) as server:
        out = await fw.generate(make_args([server.address]), make_sample(), sampling_params)
    (got,) = fw.check_call_result(out, per_turn=False)
    assert got.remove_sample and got.metadata["error_reason"] == "NO_REWARD"


async def test_metadata_without_an_instance_gives_a_placeholder_without_an_episode(
    fw, sampling_params
):
    async with agent() as server:
        sample = make_sample()
        sample.metadata = {"data_source": "x"}
        out = await fw.generate(make_args([server.address], dynamic_history=True), sample, {})
        assert server.agent.starts == []
    (got,) = fw.check_call_result(out, per_turn=True)
    assert got.metadata["error_reason"] == "INVALID_INSTANCE"


async def test_agent_failing_mid_episode_gives_an_infra_placeholder(fw, sampling_params):
    answer = lambda start: Scenario(abort_code=grpc.StatusCode.INTERNAL)  # noqa: E731
    async with agent(answer) as server:
        out = await fw.generate(make_args([server.address]), make_sample(), sampling_params)
    (got,) = fw.check_call_result(out, per_turn=False)
    assert got.metadata["infra_error"] and got.metadata["error_reason"] == "RPC_INTERNAL"


async def test_stream_ending_without_result_gives_an_infra_placeholder(fw, sampling_params):
    async with agent(lambda start: Scenario(end_without_result=True)) as server:
        out = await fw.generate(make_args([server.address]), make_sample(), sampling_params)
    (got,) = fw.check_call_result(out, per_turn=False)
    assert got.metadata["error_reason"] == "STREAM_ENDED_WITHOUT_RESULT"


async def test_unreachable_agent_gives_an_infra_placeholder(fw, sampling_params):
    async with agent() as server:
        dead = server.address
    out = await fw.generate(make_args([dead]), make_sample(), sampling_params)
    (got,) = fw.check_call_result(out, per_turn=False)
    assert got.metadata["infra_error"] and got.metadata["error_reason"] == "RPC_UNAVAILABLE"


async def test_an_unreachable_agent_is_skipped_for_the_next_address(fw, sampling_params):
    async with agent() as gone:
        dead = gone.address
    async with agent() as server:
        args = make_args([dead, server.address], connect_attempts=3)
        outs = await asyncio.gather(
            *(fw.generate(args, make_sample(index=i), sampling_params) for i in range(4))
        )
        assert len(server.agent.starts) == 4
    for out in outs:
        (got,) = fw.check_call_result(out, per_turn=False)
        assert not got.remove_sample and got.metadata["agent_address"] == server.address


async def test_concurrent_episodes_are_spread_evenly_over_the_agents(fw, sampling_params):
    slow = lambda start: Scenario(delay_before_result_s=0.3)  # noqa: E731
    async with agent(slow) as a, agent(slow) as b:
        args = make_args([a.address, b.address])
        await asyncio.gather(
            *(fw.generate(args, make_sample(index=i), sampling_params) for i in range(8))
        )
        assert len(a.agent.starts) == 4 and len(b.agent.starts) == 4


@pytest.mark.parametrize("per_turn", [False, True])
async def test_abort_flag_sends_cancel_and_every_call_returns_promptly(
    fw, sampling_params, per_turn
):
    async with agent(lambda start: Scenario(wait_for_cancel=True, gap_s=0.01)) as server:
        args = make_args([server.address], dynamic_history=per_turn)
        calls = [
            asyncio.ensure_future(fw.generate(args, make_sample(index=i), sampling_params))
            for i in range(4)
        ]
        await eventually(lambda: server.agent.active == 4)
        began = time.monotonic()
        fw.abort(args)
        outs = await asyncio.gather(*calls)
        took = time.monotonic() - began
        assert len(server.agent.cancels) == 4
    assert took < 2.0
    for out in outs:
        samples = fw.check_call_result(out, per_turn=per_turn)
        assert all(s.status is fw.Sample.Status.ABORTED and s.reward == 0.0 for s in samples)
        assert samples[0].metadata["episode_status"] == "CANCELLED"
        assert samples[0].metadata["cancelled_by"] == "abort"


async def test_agent_ignoring_cancel_has_its_call_cancelled_after_the_grace(fw, sampling_params):
    async with agent(lambda start: Scenario(ignore_cancel=True)) as server:
        args = make_args([server.address], cancel_grace_s=0.3)
        call = asyncio.ensure_future(fw.generate(args, make_sample(), sampling_params))
        await eventually(lambda: server.agent.parked == 1)
        fw.abort(args)
        out = await asyncio.wait_for(call, 2.0)
        await eventually(lambda: bool(server.agent.cancelled_calls))
        assert server.agent.cancelled_calls == [server.agent.starts[0].episode_id]
    (got,) = fw.check_call_result(out, per_turn=False)
    assert got.status is fw.Sample.Status.ABORTED and got.remove_sample
    assert got.metadata["error_reason"] == "CANCEL_UNANSWERED"


async def test_overall_deadline_cancels_the_episode(fw, sampling_params, monkeypatch):
    # The deadline is the backstop behind an agent that overruns its own bound: this agent
    # never ends on its own. A sub-second deadline must still exceed the agent's bound, so the
    # bound is made sub-second too (its fixed grading overhead and margin zeroed).
    monkeypatch.setattr(budget, "GRADING_OVERHEAD_S", 0.0)
    monkeypatch.setattr(budget, "CLIENT_MARGIN_S", 0.0)
    async with agent(lambda start: Scenario(wait_for_cancel=True)) as server:
        args = make_args(
            [server.address],
            episode_deadline_s=0.3,
            agent_lease_wait_s=0.05,
            wall_timeout_s=0.1,
            eval_timeout_s=0.1,
        )
        out = await asyncio.wait_for(fw.generate(args, make_sample(), sampling_params), 3.0)
        assert len(server.agent.cancels) == 1
    (got,) = fw.check_call_result(out, per_turn=False)
    assert got.status is fw.Sample.Status.ABORTED and got.reward == 0.0
    assert got.metadata["cancelled_by"] == "deadline"


async def test_cancelled_generate_task_cancels_the_stream(fw, sampling_params):
    async with agent(lambda start: Scenario(ignore_cancel=True)) as server:
        call = asyncio.ensure_future(
            fw.generate(make_args([server.address]), make_sample(), sampling_params)
        )
        await eventually(lambda: server.agent.parked == 1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # That the cancel reaches the agent is what is tested, not how soon. The call is
        # cancelled once parked: cancelled while gRPC was still sending `started` (CI, 7 Dec),
        # the handler never saw it, whatever the wait.
        await eventually(lambda: bool(server.agent.cancelled_calls), timeout_s=30.0)
        assert len(server.agent.cancelled_calls) == 1


async def test_response_text_is_decoded_with_the_tokenizer_the_framework_loaded(
    fw, sampling_params
):
    async with agent() as server:
        args = make_args([server.address])
        out = await fw.generate(args, make_sample(), sampling_params)
    response = out.tokens[len(out.tokens) - out.response_length :]
    assert out.response and out.response == fw.state(args).tokenizer.decode(response)


async def test_a_batch_of_generate_calls_prefetches_its_images_in_one_call(
    fw, sampling_params, tmp_path
):
    from swerl.devservers.simulated_nodes import SimulatedNode, SimulatedRegistry
    from swerl.exec.sweinstance import image_name_for
    from swerl.pool.server import PoolServer
    from swerl.pool.settings import PoolSettings

    ids = [f"swe-gym__task-{i}" for i in range(3)]
    images = [image_name_for(i, "SWE-Gym/SWE-Gym") for i in ids]
    registry = SimulatedRegistry(dict.fromkeys(images, 1 << 20))
    nodes = {"sim-0:1": SimulatedNode("sim-0", images=[], registry=registry)}
    pool = PoolServer(
        PoolSettings(
            host="127.0.0.1", port=0, insecure=True, state_dir=tmp_path, capability_secret="s"
        ),
        connect=nodes.__getitem__,
    )
    await pool.start()
    try:
        await pool.pool.register_node("sim-0", "sim-0:1", 0, {})
        async with agent() as server:
            args = make_args([server.address], pool_address=pool.address)
            samples = [
                make_sample(index=n, instance_id=ids[n % 3], image_name="") for n in range(6)
            ]
            await asyncio.gather(*(fw.generate(args, s, sampling_params) for s in samples))
        # The three distinct images were prefetched (one pull each on their home), in one call.
        await eventually(lambda: sorted(nodes["sim-0:1"].pulled) == sorted(images))
        from swerl.trainer_plugin.prefetch import _prefetchers

        (prefetcher,) = [p for key, p in _prefetchers.items() if key[0] == pool.address]
        assert prefetcher.calls == 1
        await prefetcher.close()
    finally:
        await pool.stop(0)
