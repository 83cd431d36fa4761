"""The gateway's delta rendering without jinja: a shape's content slots give exactly the ids the
chat template (the real Qwen3 one) gives for the same messages, for any contents; a shape whose
template output is not its contents written as they are is never taken from slots."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swerl.agent.gateway.render import _STAND_IN, Renderer, _fast
from swerl.agent.policy.tokens import ChatCodec
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer

TOKENIZER = str(bundled_qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(load_tokenizer(TOKENIZER), {}, TOKENIZER)


def _template_delta(codec: ChatCodec, messages: list[dict], ended: bool) -> list[int]:
    """What the gateway rendered before the slots: the template, then the tokenizer's encode."""
    text = codec.tokenizer.apply_chat_template(
        [*_STAND_IN, *messages], tokenize=False, add_generation_prompt=True
    )
    ids = codec.encode(text.split("SWERL_GATEWAY_SENTINEL_9c1e", 1)[1])
    return ids[1:] if ended and ids and ids[0] == codec.end_of_turn_id else ids


CONTENT = st.text(
    alphabet=st.sampled_from(list("ab \n\t{}%#<>/|_-\u00e9\u4e2d\U0001f600\\\"'")), max_size=60
) | st.sampled_from(
    [
        "",
        "\n",
        "  padded  ",
        "<tool_response>x</tool_response>",
        "a </think> b",
        "<think>hm</think>",
        "{{ raw }} {% if %}",
        "<|im_end|>",
    ]
)
MESSAGE = st.builds(
    lambda role, content, call_id: (
        {"role": role, "content": content} | ({"tool_call_id": call_id} if role == "tool" else {})
    ),
    st.sampled_from(["tool", "user"]),
    CONTENT,
    st.sampled_from(["call_1", "call_2"]),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), ended=st.booleans())
def test_slot_deltas_are_the_templates_ids(codec, messages, ended) -> None:
    renderer = Renderer(codec)
    sent = copy.deepcopy(messages)
    assert renderer.delta(messages, ended) == _template_delta(codec, messages, ended)
    # Twice: the second is taken from the shape's slots, measured by the first.
    assert renderer.delta(messages, ended) == _template_delta(codec, messages, ended)
    assert messages == sent  # the client's messages are not touched


def test_harness_turns_take_their_shape_from_slots(codec) -> None:
    renderer = Renderer(codec)
    shape = (("tool", ("content", "tool_call_id")),)
    shapes = _fast(codec).shapes
    shapes.pop(shape, None)
    for n in range(3):
        # A new tool_call_id every turn, as harnesses send them: one shape, measured once.
        turn = [{"role": "tool", "tool_call_id": f"call_{n}", "content": f"a{n}.py\nb.py\n"}]
        assert renderer.delta(turn, True) == _template_delta(codec, turn, True)
        assert shapes[shape] is not None
    assert sum(1 for key in shapes if key == shape) == 1
    # A content with a marker the template may branch on goes to the template, exact.
    marked = [{"role": "user", "content": "<tool_response>\nok\n</tool_response>"}]
    assert renderer.delta(marked, True) == _template_delta(codec, marked, True)


def test_a_template_that_rewrites_content_is_never_taken_from_slots() -> None:
    tokenizer = load_tokenizer(TOKENIZER)
    # The same template, but tool results trimmed: not the content written as it is.
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{- message.content }}", "{{- message.content | trim }}"
    )
    assert "message.content | trim" in tokenizer.chat_template
    codec = ChatCodec(tokenizer, {}, TOKENIZER + "#trimmed")
    renderer = Renderer(codec)
    turn = [{"role": "tool", "tool_call_id": "c", "content": "\n  out  \n"}]
    for _ in range(2):
        assert renderer.delta(turn, True) == _template_delta(codec, turn, True)
    assert _fast(codec).shapes[(("tool", ("content", "tool_call_id")),)] is None
