"""generate() end to end through the real services on the local dockerd.

Real agent, pool and exec nodes (in-process, loopback ports), the replay policy speaking SGLang's
`/generate` with the bundled Qwen3 tokenizer, the bundled tasks' images. The framework itself is
the documented stand-in (slime_standin or miles_standin): its Sample class, its generation state
(abort flag, tokenizer, sampling params) and the way it calls the hooks.
2 prompts x 4 samples, as one rollout batch would send them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest
from testkit.playback import eventually
from testkit.plugin import SAMPLING_PARAMS, make_args

from swerl.agent.server import local_agent
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir
from swerl.devservers.replay import (
    ReplayPolicyServer,
    replay_experts,
    replay_logprob,
    replay_top_p,
    script_key,
    scripts_for_tasks,
)
from swerl.stack import local_stack
from swerl.tasks import default_tasks_dir, load_tasks
from swerl.trainer_plugin import (
    filter_infra_failures,
    log_rollout_data,
    post_process_rewards,
)
from swerl.trainer_plugin.metrics import SEED_METRIC_KEYS, flatten

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("fw")]
# framework_neutral: what a test asks of the stand-in is asked under both frameworks elsewhere
# (the samples' fidelity by the 2 x 4 test in both modes, placeholders and re-runs by
# test_infra_reruns), so the miles pass of scripts/test leaves it out; the slime pass runs it.
NEUTRAL = pytest.mark.framework_neutral
PER_TURN_IDS = ["whole-trajectory", "dynamic-history"]

PROMPTS = ("swerl-examples__listutils-14", "swerl-examples__romans-5")
SAMPLES_PER_PROMPT = 4
IM_END = 151645


@dataclass
class Stack:
    args: object
    node_ids: list[str]
    stack: object
    tasks: list
    replay: ReplayPolicyServer


@contextlib.asynccontextmanager
async def real_services(
    *, nodes: int = 1, latency_s: float = 0.0, max_sandboxes: int = 8, **plugin: object
) -> AsyncIterator[Stack]:
    tasks = [t for t in load_tasks(default_tasks_dir()) if t.instance_id in PROMPTS]
    assert len(tasks) == len(PROMPTS)
    replay = ReplayPolicyServer(scripts=scripts_for_tasks(tasks), latency_s=latency_s)
    await replay.start()
    try:
        async with (
            local_stack(nodes=nodes, max_sandboxes=max_sandboxes, purpose="plugin-e2e") as stack,
            local_agent(stack.pool_address, stack.token) as agent,
        ):
            args = make_args([agent.address], agent_token=stack.token, **plugin)
            # What slime's RolloutManager has: its router and the model's HF directory.
            args.sglang_router_ip, args.sglang_router_port = replay.host, replay.port
            args.hf_checkpoint = str(bundled_qwen3_tokenizer_dir())
            node_ids = [n.settings.node_id for n in stack.nodes]
            yield Stack(args, node_ids, stack, tasks, replay)
    finally:
        await replay.stop()


def rollout_batch(fw, tasks) -> list[list]:
    """slime's groups: n samples per prompt, the dataset row under metadata["instance"]."""
    groups, index = [], 0
    for group_index, task in enumerate(tasks):
        group = []
        for _ in range(SAMPLES_PER_PROMPT):
            group.append(
                fw.Sample(
                    group_index=group_index,
                    index=index,
                    prompt=task.instance["problem_statement"],
                    metadata={"instance": dict(task.instance), "data_source": "swerl-examples"},
                )
            )
            index += 1
        groups.append(group)
    return groups


async def generate_groups(fw, args, groups, sampling_params=SAMPLING_PARAMS) -> list[list]:
    """Runs every sample of every group at once, like the framework's generate_and_rm_group."""
    calls = [
        [asyncio.ensure_future(fw.generate(args, s, dict(sampling_params))) for s in group]
        for group in groups
    ]
    return [list(await asyncio.gather(*group)) for group in calls]


def sandboxes(node_ids: list[str]) -> list[str]:
    out = []
    for node_id in node_ids:
        ps = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=swerl.node={node_id}"],
            capture_output=True,
            text=True,
            check=True,
        )
        out += ps.stdout.split()
    return out


def remove_sandboxes(node_ids: list[str]) -> None:
    left = sandboxes(node_ids)
    if left:
        subprocess.run(["docker", "rm", "-f", *left], capture_output=True, check=True)


async def no_sandbox_left(node_ids: list[str], within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    left = await asyncio.to_thread(sandboxes, node_ids)
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        left = await asyncio.to_thread(sandboxes, node_ids)
    assert not left, f"sandboxes left behind: {left}"


async def sandboxes_running(node_ids: list[str], count: int, within_s: float = 90.0) -> None:
    deadline = time.monotonic() + within_s
    while len(await asyncio.to_thread(sandboxes, node_ids)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} sandboxes after {within_s}s"
        await asyncio.sleep(0.2)


def policy_runs(sample) -> list[list[tuple[int, float]]]:
    """(token, logprob) of each maximal run of loss-mask-1 tokens: one run per policy turn."""
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    runs, current = [], []
    for token, mask, logprob in zip(
        response, sample.loss_mask, sample.rollout_log_probs, strict=True
    ):
        if mask:
            current.append((token, logprob))
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


@pytest.mark.parametrize("per_turn", [False, True], ids=["whole-trajectory", "dynamic-history"])
async def test_two_prompts_times_four_samples_resolve_with_exact_samples(fw, base_image, per_turn):
    async with real_services(dynamic_history=per_turn) as env:
        groups = await generate_groups(fw, env.args, rollout_batch(fw, env.tasks))
        await no_sandbox_left(env.node_ids)
        scripts = scripts_for_tasks(env.tasks)
        script_tokens = [  # what the replay policy samples, turn by turn, per prompt group
            [
                [*env.replay.tokenizer.encode(turn, add_special_tokens=False), IM_END]
                for turn in scripts[script_key(task.instance["problem_statement"])]
            ]
            for task in env.tasks
        ]

    for group in groups:
        for out in group:
            samples = fw.check_call_result(out, per_turn=per_turn)
            assert len(samples) == (4 if per_turn else 1), "the gold script has 4 turns"
            for sample in samples:
                assert sample.status is fw.Sample.Status.COMPLETED
                assert sample.reward == 1.0 and not sample.remove_sample
                assert sample.metadata["eval_report"]["status"] == "EVALUATION_STATUS_RESOLVED_FULL"
                assert sample.weight_versions and set(sample.weight_versions) == {"replay-1"}
                runs = policy_runs(sample)
                assert len(runs) == (1 if per_turn else 4)
                turns = script_tokens[sample.group_index]
                if per_turn:
                    turns = turns[sample.metadata["turn_index"] :][:1]
                for run, sampled in zip(runs, turns, strict=True):
                    # Exactly what the policy returned, token for token, with its logprobs.
                    assert [token for token, _ in run] == sampled
                    expected = [replay_logprob(i) for i in range(len(run))]
                    assert [lp for _, lp in run] == pytest.approx(expected, abs=1e-6)
                if per_turn:
                    assert sample.tokens[-1] == IM_END, "a turn ends with the policy's <|im_end|>"
            if per_turn:
                for earlier, later in itertools.pairwise(samples):
                    assert later.tokens[: len(earlier.tokens)] == earlier.tokens, (
                        "each turn's context extends the previous turn's"
                    )
    # The group hooks over the batch slime would assemble.
    for group in groups:
        assert fw.call_dynamic_filter(filter_infra_failures, env.args, group).keep
    flat = flatten(groups)
    raw, rewards = post_process_rewards(env.args, flat)
    assert raw == [1.0] * len(flat) and rewards == pytest.approx([0.0] * len(flat))
    extra: dict = {}
    log_rollout_data(0, env.args, flat, extra, 1.0)
    assert set(SEED_METRIC_KEYS) <= set(extra), set(SEED_METRIC_KEYS) - set(extra)
    assert extra["agent/episodes"] == 8.0 and extra["agent/resolved_ratio"] == 1.0


async def test_abort_flag_mid_episode_returns_every_call_within_two_seconds(fw, base_image):
    async with real_services(latency_s=1.0, dynamic_history=True) as env:
        batch = rollout_batch(fw, env.tasks)
        calls = [
            asyncio.ensure_future(fw.generate(env.args, s, dict(SAMPLING_PARAMS)))
            for group in batch
            for s in group
        ]
        # Mid-episode: every episode holds its sandbox and has asked the policy for a turn.
        await eventually(lambda: env.replay.stats.requests >= 2 * len(calls), 120.0)
        began = time.monotonic()
        fw.abort(env.args)
        outs = await asyncio.wait_for(asyncio.gather(*calls), 10.0)
        took = time.monotonic() - began
        print(f"abort: {len(calls)} generate calls returned {took:.2f}s after the flag")
        assert took < 2.0, f"calls returned {took:.2f}s after the abort flag"
        await no_sandbox_left(env.node_ids)
    for out in outs:
        samples = fw.check_call_result(out, per_turn=True)
        assert all(s.status is fw.Sample.Status.ABORTED and s.reward == 0.0 for s in samples)
        assert samples[0].metadata["cancelled_by"] == "abort"
    for group in batch:
        results = [outs[s.index] for s in group]
        assert not fw.call_dynamic_filter(filter_infra_failures, env.args, results).keep


async def kill_a_node_mid_rollout(fw, env, wait_s: float) -> list[list]:
    """Runs a rollout batch and stops the first exec node while episodes hold sandboxes on it;
    returns the groups' generate results (each group within `wait_s` of the kill)."""
    batch = rollout_batch(fw, env.tasks)
    calls = [
        [asyncio.ensure_future(fw.generate(env.args, s, dict(SAMPLING_PARAMS))) for s in group]
        for group in batch
    ]
    # Mid-rollout: the episodes hold sandboxes on both nodes and are talking to the policy.
    await eventually(lambda: env.replay.stats.requests >= 8, 120.0)
    await sandboxes_running(env.node_ids[:1], 2)
    killed = env.stack.nodes[0]
    try:
        await killed.stop(0)
        groups = [list(await asyncio.wait_for(asyncio.gather(*g), wait_s)) for g in calls]
        await no_sandbox_left(env.node_ids[1:])
    finally:
        # A stopped node leaves its sandboxes for adoption at its restart, which never
        # comes here: remove them as the node's reaper would.
        await asyncio.to_thread(remove_sandboxes, env.node_ids[:1])
    return groups


@NEUTRAL
async def test_episodes_on_a_killed_exec_node_are_rerun_and_every_group_is_kept(fw, base_image):
    async with real_services(nodes=2, latency_s=0.5, max_sandboxes=4) as env:
        # The re-runs wait for room on the surviving node: a longer bound than without them.
        groups = await kill_a_node_mid_rollout(fw, env, 300.0)
    rerun = 0
    for group in groups:
        samples = [fw.check_call_result(out, per_turn=False)[0] for out in group]
        for s in samples:
            assert not s.remove_sample and s.status is fw.Sample.Status.COMPLETED
            assert s.reward == 1.0
            attempts = s.metadata["episode_attempts"]
            assert attempts == len(s.metadata["rerun_reasons"]) + 1
            rerun += attempts > 1
        assert fw.call_dynamic_filter(filter_infra_failures, env.args, samples).keep
    assert rerun >= 2, "the episodes on the killed node ran again"
    extra: dict = {}
    log_rollout_data(0, env.args, flatten(groups), extra, 1.0)
    assert extra["agent/infra_error_ratio"] == 0.0
    assert extra["agent/infra_reruns_sum"] >= rerun and extra["agent/infra_recovered_ratio"] == 1.0


@NEUTRAL
async def test_exec_node_killed_mid_rollout_gives_placeholders_the_filter_drops(fw, base_image):
    # Without re-runs (episode_attempts=1) the failures reach the filter.
    async with real_services(nodes=2, latency_s=0.5, max_sandboxes=4, episode_attempts=1) as env:
        groups = await kill_a_node_mid_rollout(fw, env, 120.0)
    placeholders, kept = 0, 0
    for group in groups:
        samples = [fw.check_call_result(out, per_turn=False)[0] for out in group]
        broken = [s for s in samples if s.remove_sample]
        for s in broken:
            assert s.metadata["infra_error"] is True and s.reward == 0.0
            assert s.status is fw.Sample.Status.FAILED
            assert s.metadata["error_reason"], "the cause is named"
        for s in samples:
            if not s.remove_sample:
                assert s.status is fw.Sample.Status.COMPLETED and s.reward == 1.0
        verdict = fw.call_dynamic_filter(filter_infra_failures, env.args, samples)
        assert verdict.keep == (not broken)
        placeholders += len(broken)
        kept += verdict.keep
    assert placeholders >= 1, "episodes on the killed node end as infra placeholders"
    extra: dict = {}
    log_rollout_data(0, env.args, flatten(groups), extra, 1.0)
    assert extra["agent/infra_error_ratio"] == pytest.approx(placeholders / 8)


@pytest.mark.parametrize("per_turn", [pytest.param(False, marks=NEUTRAL), True], ids=PER_TURN_IDS)
async def test_top_p_and_routing_replay_carry_what_the_policy_returned(fw, base_image, per_turn):
    async with real_services(dynamic_history=per_turn) as env:
        args = env.args
        args.rollout_top_p = 0.9  # slime then asks SGLang for the kept top-p sets
        args.use_rollout_routing_replay = True
        args.num_layers, args.moe_router_topk = 2, 2  # the replay server's 4 experts per token
        params = fw.state(args).sampling_params  # what the framework passes to generate
        groups = await generate_groups(fw, args, rollout_batch(fw, env.tasks), params)
        calls = list(env.replay.stats.calls)

    samples = flatten(groups)
    asked_top_p = "custom_params" in params  # slime asks; miles has no top-p replay
    assert asked_top_p == (fw.NAME == "slime")
    for sample in samples:
        fw.check_sample_invariants(sample)
        assert not sample.remove_sample and sample.reward == 1.0
        # Routed experts: every token but the last, as the policy routed it.
        experts = np.asarray(sample.rollout_routed_experts)
        assert experts.shape == (len(sample.tokens) - 1, 2, 2)
        for row, token in zip(experts, sample.tokens, strict=False):
            assert row.reshape(-1).tolist() == replay_experts(token)
        if not asked_top_p:
            assert getattr(sample, "rollout_top_p_token_offsets", None) is None
            continue
        ids, offsets = sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets
        assert len(offsets) == sample.response_length + 1 and offsets[-1] == len(ids)
        response = sample.tokens[len(sample.tokens) - sample.response_length :]
        position = 0  # within the current policy call's output
        for i, (token, mask) in enumerate(zip(response, sample.loss_mask, strict=True)):
            kept = ids[offsets[i] : offsets[i + 1]]
            if mask:
                assert kept == replay_top_p(position, token), (i, token)
                position += 1
            else:
                assert kept == [], "observation tokens have empty spans"
                position = 0
    # The framework builds train data from them without error.
    data = fw.train_data(args, groups)
    assert len(data["rollout_routed_experts"]) == len(samples)
    if asked_top_p:
        assert len(data["rollout_top_p_token_offsets"]) == len(samples)
    # Prefix-cache affinity: one routing key per episode on every policy call.
    episodes = {s.metadata["episode_id"] for s in samples}
    keys = [
        next(v for k, v in call.headers.items() if k.lower() == "x-smg-routing-key")
        for call in calls
    ]
    assert set(keys) == episodes and len(episodes) == 8
    turns_per_episode = {key: keys.count(key) for key in episodes}
    assert set(turns_per_episode.values()) == {4}, "every turn of an episode carries its key"


@pytest.mark.parametrize("per_turn", [pytest.param(False, marks=NEUTRAL), True], ids=PER_TURN_IDS)
async def test_branching_groups_share_their_trunk_through_the_real_services(
    fw, base_image, per_turn
):
    # Each group's trunk and its 4 forks are on the node together at the fork.
    async with real_services(max_sandboxes=10, branch_at_turn=2, dynamic_history=per_turn) as env:
        groups = await generate_groups(fw, env.args, rollout_batch(fw, env.tasks))
        await no_sandbox_left(env.node_ids)
        # Per group: the trunk's 2 turns once, then 2 turns in each of the 4 branches.
        policy_calls = env.replay.stats.requests
    assert policy_calls == len(PROMPTS) * (2 + SAMPLES_PER_PROMPT * 2)

    for group in groups:
        lists = [fw.check_call_result(out, per_turn=per_turn) for out in group]
        episode = {s.metadata["branch_episode_id"] for samples in lists for s in samples}
        assert len(episode) == 1, "one episode per prompt group"
        assert [samples[-1].metadata["branch"] for samples in lists] == [0, 1, 2, 3]
        assert len({samples[-1].metadata["sampling_seed"] for samples in lists}) == 4
        for samples in lists:
            for sample in samples:
                assert sample.status is fw.Sample.Status.COMPLETED
                assert sample.reward == 1.0 and not sample.remove_sample
        if per_turn:
            # Every member: its own copy of the trunk's 2 turns, then its own 2 turns.
            assert [len(samples) for samples in lists] == [4, 4, 4, 4]
            trunk_context = lists[0][1].tokens
            for samples in lists:
                assert [s.metadata["branch_trunk"] for s in samples] == [True, True, False, False]
                assert samples[1].tokens == trunk_context
                assert samples[-2].tokens[: len(trunk_context)] == trunk_context
        else:
            whole = [samples[0] for samples in lists]
            # The trunk's 2 turns: the same tokens, masks and logprobs in every member.
            runs = [policy_runs(s) for s in whole]
            assert all(len(r) == 4 for r in runs)
            assert all(r[:2] == runs[0][:2] for r in runs)
            prefix = len(whole[0].tokens) - whole[0].response_length
            first = whole[0]
            for sample in whole:
                assert sample.tokens[:prefix] == first.tokens[:prefix]
    flat = flatten(groups)
    for group in groups:
        assert fw.call_dynamic_filter(filter_infra_failures, env.args, group).keep
    raw, rewards = post_process_rewards(env.args, flat)
    assert raw == [1.0] * len(flat) and rewards == pytest.approx([0.0] * len(flat))
    fw.train_data(env.args, groups)
