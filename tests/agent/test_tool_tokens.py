"""Token-exactness of the `tool_calls` protocol with the real Qwen3 tokenizer and template:
random tool-call episodes (parallel calls, bad calls, reasoning, replies without a call, context
trims) through TokenMode, with a scripted policy behind swerl's TokenPolicy Protocol.

Every record's tokens are exactly what the policy was sent plus what it sampled, the loss mask
is 1 exactly on the sampled ids, and, while the conversation is a plain tool loop, the prompt
the agent built by appending is token for token what Qwen3's own template renders for the same
messages (tools declared, reasoning kept, as the template keeps it after the last user query).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swerl.agent.actions.tool_turn import assistant_message, parse_sampled
from swerl.agent.actions.toolcalls import CallIds
from swerl.agent.config import load_config
from swerl.agent.policy.clients import Generation
from swerl.agent.policy.modes import ContextExhausted, TokenMode
from swerl.agent.policy.tokens import ChatCodec
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer

CONFIG = load_config("tools")
SYSTEM, USER = "You fix bugs.", "Fix parse() in /testbed/p.py."


class Codec(ChatCodec):
    def decode_special(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(load_tokenizer(bundled_qwen3_tokenizer_dir()), CONFIG.template_kwargs())


class ScriptedPolicy:
    """Samples the given texts as ids (with logprobs) and keeps every prompt it was sent."""

    def __init__(self, codec: ChatCodec, replies: list[tuple[str, bool]]) -> None:
        self._codec = codec
        self._replies = replies
        self.sent: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def generate(self, input_ids: Sequence[int], max_new_tokens: int) -> Generation:
        text, ended = self._replies[len(self.sent)]
        ids = self._codec.encode(text) + ([self._codec.end_of_turn_id] if ended else [])
        finish = "stop" if ended else "length"
        self.sent.append(list(input_ids))
        self.sampled.append(ids)
        logprobs = [-0.01 - 0.001 * (i % 50) for i in range(len(ids))]
        return Generation(ids, logprobs, finish, weight_version="w1")

    def reseeded(self, sampling_seed: int) -> ScriptedPolicy:
        return self


_WORD = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")) | st.sampled_from(["\n", "é"]),
    min_size=1,
    max_size=12,
).filter(lambda s: "<" not in s and s.strip() == s and s.strip())
_ARGS = st.fixed_dictionaries(
    {"command": _WORD}, optional={"timeout": st.integers(1, 100)}
) | st.fixed_dictionaries(
    {
        "command": st.just("str_replace_editor"),
        "path": st.just("/testbed/p.py"),
        "view_range": st.lists(st.integers(1, 9), min_size=2, max_size=2),
    }
)


@st.composite
def replies(draw: Any) -> tuple[str, bool, bool]:
    """A reply as Qwen3 writes it: optional reasoning, optional content, 0-3 calls (some
    malformed); whether it ended on <|im_end|>; whether it is the template's canonical form."""
    reasoning = draw(st.none() | _WORD)
    content = draw(st.none() | _WORD)
    calls = []
    canonical = True
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["bash", "edit", "malformed", "unknown"]))
        if kind == "malformed":
            calls.append('<tool_call>\n{"name": "bash", "arguments": {"command": \n</tool_call>')
            canonical = False
            continue
        name = {"bash": "bash", "edit": "str_replace_editor", "unknown": "python"}[kind]
        arguments = draw(_ARGS)
        calls.append(
            f'<tool_call>\n{{"name": "{name}", "arguments": '
            f"{json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>"
        )
    text = ""
    if reasoning is not None:
        text += f"<think>\n{reasoning}\n</think>\n\n"
    text += content or ""
    for index, call in enumerate(calls):
        text += ("\n" if content or index else "") + call
    ended = draw(st.booleans())
    if not text:
        text = "ok"
        canonical = False
    return text, ended, canonical and ended and bool(calls)


def _tool_replies(parsed: Any) -> list[dict[str, Any]]:
    """What the agent answers: a tool message per call, or a user message without a call."""
    if not parsed.calls:
        return [{"role": "user", "content": "Your reply called no tool."}]
    return [
        {"role": "tool", "tool_call_id": call.id, "content": f"out {i} é\n<returncode>0</"}
        for i, call in enumerate(parsed.calls)
    ]


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(turns=st.lists(replies(), min_size=1, max_size=6), budget=st.sampled_from([0, 900, 1100]))
def test_tool_call_episodes_are_token_exact(codec, turns, budget) -> None:
    asyncio.run(_episode(codec, turns, budget))


async def _episode(
    codec: Codec, turns: list[tuple[str, bool, bool]], budget: int
) -> tuple[int, int]:
    """Plays the turns; returns how many prompts were checked against the template and how
    many were trimmed."""
    policy = ScriptedPolicy(codec, [(text, ended) for text, ended, _ in turns])
    mode = TokenMode(
        policy,
        codec,
        max_context_tokens=budget,
        max_new_tokens=64,
        omission_text=lambda n: f"[{n} earlier turns omitted]",
    )
    await mode.open(SYSTEM, USER)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
    ]
    ids = CallIds(seed=3)
    plain_loop = True  # no trim and no plain user message yet: the template agrees
    template_checked = trims = 0
    for turn, (_text, _ended, canonical) in enumerate(turns):
        try:
            answer = await mode.respond(messages)
        except ContextExhausted:  # the budget cannot hold even the latest turn
            assert budget
            break
        plain_loop = plain_loop and not answer.context_trimmed
        trims += answer.context_trimmed
        assert policy.sampled[turn] and answer.response_tokens == len(policy.sampled[turn])
        parsed = parse_sampled(answer.text, CONFIG, answer.finish_reason, ids)
        if plain_loop:
            expected = codec.tokenizer.apply_chat_template(
                messages,
                tools=CONFIG.template_kwargs()["tools"],
                add_generation_prompt=True,
                tokenize=False,
            )
            assert codec.decode(policy.sent[turn]) == codec.decode(codec.encode(expected))
            assert policy.sent[turn] == codec.encode(expected)
            template_checked += 1
        messages.append(assistant_message(parsed))
        answers = _tool_replies(parsed)
        plain_loop = plain_loop and canonical and answers[0]["role"] == "tool"
        messages += answers
        await mode.observe(answers)

    # Trims drop whole turns: a tool response always follows the reply that made its calls.
    for sent in policy.sent:
        segments = codec.decode_special(sent).split("<|im_start|>")
        for before, segment in itertools.pairwise(segments):
            if segment.startswith("user\n<tool_response>"):
                assert before.startswith("assistant\n"), (before, segment)
    # Per turn (dynamic history): exactly what was sent, exactly what was sampled, mask 1.
    records = mode.turn_records()
    assert len(records) == len(policy.sent)
    for record, sent, sampled in zip(records, policy.sent, policy.sampled, strict=True):
        record.check()
        assert record.prompt_ids == sent and record.response_ids == sampled
        assert record.loss_mask == [1] * len(sampled)
    if not records:
        return template_checked, trims
    # One record per chain (a trim starts a new chain): each is its first prompt plus what
    # followed it, and equals the chain's last prompt plus its last sample; the loss mask is 1
    # exactly where the policy sampled. An untrimmed episode is one chain.
    chains = mode.whole_records()
    turn = 0
    for chain in chains:
        chain.check()
        stream = chain.prompt_ids + chain.response_ids
        sampled_at: list[int] = []
        first = turn
        while turn < len(policy.sent) and stream[: len(policy.sent[turn])] == policy.sent[turn]:
            sent, sampled = policy.sent[turn], policy.sampled[turn]
            if len(sent) + len(sampled) > len(stream):
                break
            assert stream[len(sent) : len(sent) + len(sampled)] == sampled
            sampled_at += range(len(sent), len(sent) + len(sampled))
            turn += 1
        assert turn > first and chain.prompt_ids == policy.sent[first]
        assert stream == policy.sent[turn - 1] + policy.sampled[turn - 1]
        offset = len(chain.prompt_ids)
        assert [i + offset for i, m in enumerate(chain.loss_mask) if m] == sampled_at
    assert turn == len(policy.sent)
    assert len(chains) == 1 + trims
    return template_checked, trims


def test_a_plain_tool_loop_prompt_is_what_the_qwen3_template_renders(codec) -> None:
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    turns = [
        (f"<think>\nlook\n</think>\n\nFirst a look.\n{call}\n{call}", True, True),
        (f"<think>\nagain\n</think>\n\n{call}", True, True),
        (f"Done.\n{call}", True, True),
        ("<think>\nok\n</think>\n\nAll good.", True, False),
    ]
    assert asyncio.run(_episode(codec, turns, 0)) == (4, 0)


def test_trims_keep_each_reply_with_its_tool_messages(codec) -> None:
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat a.py"}}\n</tool_call>'
    turns = [
        (f"<think>\nstep {i}\n</think>\n\nReading.\n{call}\n{call}", True, True) for i in range(12)
    ]
    checked, trims = asyncio.run(_episode(codec, turns, 1100))
    assert trims >= 1 and checked >= 1


def test_dropping_earlier_reasoning_forks_a_chain_per_turn_and_matches_the_template() -> None:
    """`history_reasoning: drop`: later prompts leave earlier reasoning out, as Qwen3's template
    does before the last user message (the bash-block protocol, whose observations are user
    messages); each prompt is then a new chain, and every chain is still exact."""
    plain = Codec(load_tokenizer(bundled_qwen3_tokenizer_dir()))
    replies = [
        ("<think>\nlook around\n</think>\n\nFirst a look.\n\n```bash\nls\n```", True),
        ("<think>\nnow the file\n</think>\n\nThe file.\n\n```bash\ncat a.py\n```", True),
        ("Done.\n\n```bash\necho ok\n```", True),
    ]

    async def play() -> tuple[ScriptedPolicy, TokenMode, list[dict[str, Any]]]:
        policy = ScriptedPolicy(plain, replies)
        mode = TokenMode(
            policy,
            plain,
            max_context_tokens=0,
            max_new_tokens=64,
            omission_text=lambda n: "",
            drop_reasoning=True,
        )
        await mode.open(SYSTEM, USER)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER},
        ]
        for index, (text, _) in enumerate(replies):
            await mode.respond(messages)
            messages.append({"role": "assistant", "content": text})
            observation = f"<returncode>0</returncode>\nout {index}"
            messages.append({"role": "user", "content": observation})
            await mode.observe(observation)
        return policy, mode, messages

    policy, mode, messages = asyncio.run(play())
    second, third = (plain.decode_special(ids) for ids in policy.sent[1:])
    assert "look around" not in second and "First a look." in second
    assert "now the file" not in third and "look around" not in third
    for turn, sent in enumerate(policy.sent):
        rendered = plain.tokenizer.apply_chat_template(
            messages[: 2 + 2 * turn], tokenize=False, add_generation_prompt=True
        )
        assert plain.decode_special(sent) == rendered
    # Turns 1 and 2 do not extend the prompt before them (the reasoning went): three chains,
    # each exactly its prompt and its sampled ids. Turn 2 had no reasoning, but its prompt
    # already differs from turn 1's prompt plus what followed.
    chains = mode.whole_records()
    assert len(chains) == 3
    for chain, sent, sampled in zip(chains, policy.sent, policy.sampled, strict=True):
        chain.check()
        assert chain.prompt_ids == sent and chain.response_ids == sampled
        assert chain.loss_mask == [1] * len(sampled)
