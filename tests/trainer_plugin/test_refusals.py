"""Flag combinations refused at the first generate call, naming the flags, before any episode
runs (issue 23, item 5); miles' compact-batch rule (item 4). Upstream facts: refusals.py."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from testkit.playback import PlaybackAgent, PlaybackServer, Scenario, asks_top_p, result
from testkit.plugin import FRAMEWORK, make_args, make_sample

from swerl.agent.v1 import agent_pb2
from swerl.trainer_plugin.hooks import PluginConfigError
from swerl.trainer_plugin.replay import TopPReplayError

pytestmark = pytest.mark.usefixtures("fw")

# (framework flags, plugin settings, the flags the one-line refusal must name), per framework.
# Issue 41 point 9, in both frameworks: swerl's reward is one float set by the plugin.
REWARD_CASES: list[tuple[dict[str, Any], dict[str, Any], list[str]]] = [
    ({"group_rm": True}, {}, ["--group-rm"]),
    ({"reward_key": "score"}, {}, ["--reward-key score"]),
    ({"eval_reward_key": "accuracy"}, {}, ["--eval-reward-key accuracy"]),
    # Issue 41 point 8: the budget (16384, make_args' --rollout-max-context-len) over the
    # engine's context length.
    (
        {"sglang_allow_auto_truncate": True, "sglang_context_length": 8192},
        {},
        ["--sglang-allow-auto-truncate", "16384", "8192"],
    ),
    ({"sglang_allow_auto_truncate": True}, {}, ["--sglang-allow-auto-truncate", "unknown"]),
    # Issue 41 point 4: static micro-batches at dp 4 (4 GPUs, no model parallelism), and at dp 2
    # x a micro-batch group of 2 (8 GPUs, pipeline 2 with virtual stages).
    (
        {"actor_num_gpus_per_node": 4},
        {"dynamic_history": True},
        ["--use-dynamic-batch-size", "of 4"],
    ),
    (
        {
            "actor_num_gpus_per_node": 8,
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
        },
        {"dynamic_history": True},
        ["--use-dynamic-batch-size", "of 4"],
    ),
]
CASES: dict[str, list[tuple[dict[str, Any], dict[str, Any], list[str]]]] = {
    "slime": [
        *REWARD_CASES,
        ({"partial_rollout": True}, {"dynamic_history": True}, ["--partial-rollout"]),
        ({"log_passrate": True}, {"dynamic_history": True}, ["--log-passrate"]),
    ],
    "miles": [
        *REWARD_CASES,
        ({"partial_rollout": True}, {"dynamic_history": True}, ["--partial-rollout"]),
        (
            {"recompute_logprobs_via_prefill": True},
            {"dynamic_history": True},
            ["--recompute-logprobs-via-prefill"],
        ),
        (
            {"use_dynamic_global_batch_size": True},
            {"dynamic_history": True},
            ["--use-dynamic-global-batch-size"],
        ),
        ({"multi_lora": True}, {"dynamic_history": True}, ["--multi-lora"]),
        ({"use_rollout_indexer_replay": True}, {}, ["--use-rollout-indexer-replay"]),
    ],
}


@pytest.mark.parametrize(
    ("flags", "plugin", "named"), CASES[FRAMEWORK], ids=[str(c[0]) for c in CASES[FRAMEWORK]]
)
async def test_a_refused_flag_combination_is_one_line_naming_the_flags_before_any_episode(
    fw, sampling_params, flags, plugin, named
) -> None:
    agent = PlaybackAgent(lambda start: Scenario(result=result(start)))
    async with PlaybackServer(agent) as server:
        args = make_args([server.address], **plugin)
        for key, value in flags.items():
            setattr(args, key, value)
        with pytest.raises(PluginConfigError) as caught:
            await fw.generate(args, make_sample(), sampling_params)
    message = str(caught.value)
    assert "\n" not in message
    for flag in named:
        assert flag in message
    if plugin.get("dynamic_history"):
        assert "swerl_dynamic_history" in message
    assert agent.starts == [], "refused before any episode ran"


def _chains(start: agent_pb2.EpisodeStart) -> agent_pb2.EpisodeResult:
    """A whole-trajectory result whose history was trimmed once: two chains."""
    out = result(start)
    whole = out.trajectory
    cut = 9  # the first chain: the first turn's response and observation (3 + 2 tokens) ...
    first = agent_pb2.TokenRecord(
        prompt_ids=whole.prompt_ids,
        response_ids=whole.response_ids[:3],
        loss_mask=whole.loss_mask[:3],
        logprobs=whole.logprobs[:3],
        reward=whole.reward,
    )
    second = agent_pb2.TokenRecord(
        prompt_ids=[*whole.prompt_ids[:4], 77, 78, *whole.prompt_ids[-3:]],
        response_ids=whole.response_ids[cut - 4 :],
        loss_mask=whole.loss_mask[cut - 4 :],
        logprobs=whole.logprobs[cut - 4 :],
        reward=whole.reward,
    )
    out.ClearField("trajectory")
    out.chains.extend([first, second])
    return out


async def test_a_trimmed_episode_is_a_list_of_chains_sharing_rollout_id(fw, sampling_params):
    async with PlaybackServer(PlaybackAgent(lambda s: Scenario(result=_chains(s)))) as server:
        args = make_args([server.address])
        out = await fw.generate(args, make_sample(index=4), sampling_params)
        evaluated = await fw.generate(args, make_sample(index=5), sampling_params, True)
    samples = fw.check_call_result(out, per_turn=False, chains=2)
    assert {s.rollout_id for s in samples} == {4}
    assert [s.reward for s in samples] == [1.0, 1.0]
    assert samples[1].tokens[:9] == [*samples[0].tokens[:4], 77, 78, *samples[0].tokens[9:12]]
    # Evaluation counts episodes: the last chain alone.
    (last,) = fw.check_call_result(evaluated, per_turn=False)
    assert last.tokens == samples[1].tokens
    args.n_samples_per_prompt, args.rollout_batch_size = 1, 1
    data = fw.train_data(args, [[out]])
    # The loss reducer counts the episode once: both chains share one denominator.
    sums = data["rollout_mask_sums"]
    assert sums[0] == sums[1] == sum(samples[0].loss_mask) + sum(samples[1].loss_mask)


LIST_REFUSING_FLAGS = {
    "slime": ["partial_rollout", "log_passrate"],
    "miles": [
        "partial_rollout",
        "use_dynamic_global_batch_size",
        "multi_lora",
        "recompute_logprobs_via_prefill",
    ],
}


@pytest.mark.parametrize("flag", LIST_REFUSING_FLAGS[FRAMEWORK])
async def test_where_lists_are_refused_a_trimmed_episode_gives_its_last_chain(
    fw, sampling_params, flag
) -> None:
    async with PlaybackServer(PlaybackAgent(lambda s: Scenario(result=_chains(s)))) as server:
        args = make_args([server.address])
        setattr(args, flag, True)
        out = await fw.generate(args, make_sample(index=4), sampling_params)
    (sample,) = fw.check_call_result(out, per_turn=False)
    assert sample.tokens[4:6] == [77, 78] and sample.rollout_id is None
    if flag == "use_dynamic_global_batch_size" and FRAMEWORK == "miles":
        args.n_samples_per_prompt, args.rollout_batch_size = 1, 1
        fw.train_data(args, [[out]])


async def test_miles_dynamic_global_batch_size_gets_no_compact_batch(fw, sampling_params):
    """A lone sample carries no rollout_id, so miles computes its dynamic global batch size
    (its rollout_data_conversion.py:30-41 would skip it for a compact batch and
    train_data_conversion.py:154-155 assert)."""
    agent = PlaybackAgent(lambda start: Scenario(result=result(start)))
    async with PlaybackServer(agent) as server:
        args = make_args([server.address])
        args.use_dynamic_global_batch_size = True
        outs = [await fw.generate(args, make_sample(0, i), sampling_params) for i in range(2)]
    for out in outs:
        (sample,) = fw.check_call_result(out, per_turn=False)
        assert sample.rollout_id is None
    args.n_samples_per_prompt, args.rollout_batch_size = 2, 1
    fw.train_data(args, [outs])


@pytest.mark.parametrize("agent_side", [False, True])
async def test_top_p_below_one_against_an_engine_without_top_p_sets_stops_at_the_first_call(
    fw, agent_side
):
    """Stock SGLang returns no top-p sets (only slime's patched v0.5.15.post1 does): the first
    generate call raises naming the flag, instead of every episode becoming a dropped
    placeholder and the rollout resampling forever."""

    def answer(start: agent_pb2.EpisodeStart) -> Scenario:
        if agent_side:  # what swerl's agent answers when the engine's reply lacks the sets
            failed = result(
                start,
                agent_pb2.EPISODE_STATUS_INFRA_ERROR,
                reward=None,
                error_reason="POLICY_BAD_REPLY",
                error_message="the sampling params ask for top-p token ids but the policy"
                " reply has no meta_info.top_p_token_ids/top_p_token_offsets",
            )
            return Scenario(result=failed)
        return Scenario(result=result(start, with_replay=False))

    agent = PlaybackAgent(answer)
    async with PlaybackServer(agent) as server:
        args = make_args([server.address])
        args.rollout_top_p = 0.9
        params = dict(fw.state(args).sampling_params)
        if fw.NAME == "miles":  # miles has no top-p replay: the agent is never asked for sets
            out = await fw.generate(args, make_sample(), params)
            # The agent-side INFRA_ERROR is then an ordinary infra failure, re-run (reruns.py)
            # up to the default 3 attempts.
            assert len(agent.starts) == (3 if agent_side else 1)
            assert not any(asks_top_p(start) for start in agent.starts)
            if not agent_side:
                (sample,) = fw.check_call_result(out, per_turn=False)
                assert not sample.remove_sample
            return
        with pytest.raises(TopPReplayError) as caught:
            await fw.generate(args, make_sample(), params)
    assert "--rollout-top-p" in str(caught.value) and "\n" not in str(caught.value)
    assert len(agent.starts) == 1


@pytest.mark.parametrize(("dynamic", "chains"), [(False, 1), (True, 2)])
async def test_static_micro_batches_at_dp_over_one_take_the_last_chain_alone(
    fw, sampling_params, dynamic, chains
):
    """Issue 41 point 4: without --use-dynamic-batch-size, a step's micro-batch count must be a
    multiple of dp (slime/miles dp_schedule); a trimmed episode's chains as a list would vary
    the step's sample count, so the last chain comes alone. With dynamic batches, the list."""
    async with PlaybackServer(PlaybackAgent(lambda s: Scenario(result=_chains(s)))) as server:
        args = make_args([server.address])
        args.actor_num_gpus_per_node, args.use_dynamic_batch_size = 4, dynamic
        out = await fw.generate(args, make_sample(index=4), sampling_params)
    samples = fw.check_call_result(out, per_turn=False, chains=chains)
    assert samples[-1].reward == 1.0


def _slime_source(root, reducer: bool) -> None:
    """A slime checkout's megatron_utils/data.py as v0.3.1 (per-rollout denominators) or as
    v0.2.4 / v0.3.0 (none) has it."""
    data = root / "backends" / "megatron_utils" / "data.py"
    data.parent.mkdir(parents=True)
    name = "rollout_mask_sums" if reducer else "num_steps_per_rollout"
    data.write_text(f'def log_rollout_data(rollout_data):\n    x = rollout_data.get("{name}")\n')


@pytest.mark.parametrize("reducer", [False, True])
async def test_slime_without_the_per_rollout_reducer_refuses_lists(
    fw, sampling_params, tmp_path, monkeypatch, reducer
):
    """Issue 41 point 2: slime v0.2.2-v0.3.0 reduce the loss per sample (no rollout_mask_sums),
    so an episode's list would weigh as many episodes: dynamic history is refused in one line,
    and a trimmed episode gives its last chain alone. From v0.3.1 both go through. Under miles
    a slime source beside it changes nothing."""
    _slime_source(tmp_path, reducer)
    slime = sys.modules.get("slime") or types.ModuleType("slime")
    monkeypatch.setitem(sys.modules, "slime", slime)
    monkeypatch.setattr(slime, "__path__", [str(tmp_path)], raising=False)
    refused = fw.NAME == "slime" and not reducer
    agent = PlaybackAgent(lambda s: Scenario(result=_chains(s)))
    async with PlaybackServer(agent) as server:
        per_turn = make_args([server.address], dynamic_history=True)
        if refused:
            with pytest.raises(PluginConfigError, match=r"needs slime v0\.3\.1 or later"):
                await fw.generate(per_turn, make_sample(index=1), sampling_params)
        else:
            await fw.generate(per_turn, make_sample(index=1), sampling_params)
        whole = make_args([server.address])
        out = await fw.generate(whole, make_sample(index=4), sampling_params)
    fw.check_call_result(out, per_turn=False, chains=1 if refused else 2)
