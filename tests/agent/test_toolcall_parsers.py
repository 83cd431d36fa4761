"""The tool-call and reasoning parsers on text fixtures written from each format's documentation
(the model cards' and chat templates' examples), plus the real Qwen3 template's own rendering."""

from __future__ import annotations

import pytest

from swerl.agent.actions.toolcalls import (
    REASONING_PARSERS,
    TOOL_CALL_FORMATS,
    CallIds,
    UnknownParserError,
    get_reasoning_parser,
    get_tool_call_format,
    parse_reply,
)
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir, load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout": {"type": "integer"},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "edit",
            "description": "Edit a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "enum": ["view", "create"]},
                    "path": {"type": "string"},
                    "file_text": {"type": "string"},
                    "view_range": {"type": "array", "items": {"type": "integer"}},
                },
                "required": ["command", "path"],
            },
        },
    },
]


def parse(text: str, parser: str, *, reasoning: str | None = "qwen3", finish: str = "stop"):
    return parse_reply(
        text,
        tool_call_parser=parser,
        reasoning_parser=reasoning,
        tools=TOOLS,
        finish_reason=finish,
        new_id=CallIds(seed=7),
    )


# ---- the registry -------------------------------------------------------------------------


def test_registry_uses_sglang_parser_names():
    assert {"qwen25", "qwen", "qwen3_coder", "glm45", "glm", "glm47"} <= set(TOOL_CALL_FORMATS)
    assert {"qwen3", "qwen3-thinking", "glm45", "deepseek-r1"} <= set(REASONING_PARSERS)


def test_unknown_parser_names_are_refused_with_the_known_ones():
    with pytest.raises(UnknownParserError, match=r"unknown tool-call parser 'hermes2'.*qwen25"):
        get_tool_call_format("hermes2")
    with pytest.raises(UnknownParserError, match=r"unknown reasoning parser 'qwen4'.*qwen3"):
        get_reasoning_parser("qwen4")


def test_seeded_call_ids_are_reproducible_and_openai_shaped():
    first, second = CallIds(seed=3), CallIds(seed=3)
    ids = [first() for _ in range(3)]
    assert ids == [second() for _ in range(3)]
    assert len(set(ids)) == 3
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert CallIds()() != CallIds()()


# ---- qwen25: Qwen2.5 / Qwen3 Hermes-style JSON ---------------------------------------------

# Qwen3's model card / template: reasoning, then one JSON object per <tool_call> block.
QWEN_TWO_CALLS = (
    "<think>\nI should look at the tree first.\n</think>\n\n"
    "Let me look around.\n"
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "edit", "arguments": {"command": "view", "path": "/repo/a.py",'
    ' "view_range": [1, 20]}}\n</tool_call>'
)


def test_qwen25_reads_reasoning_content_and_two_calls_in_order():
    result = parse(QWEN_TWO_CALLS, "qwen25")
    assert result.reasoning == "I should look at the tree first."
    assert result.content == "Let me look around."
    assert [c.name for c in result.calls] == ["bash", "edit"]
    assert result.calls[0].arguments == {"command": "ls -la"}
    assert result.calls[1].arguments == {
        "command": "view",
        "path": "/repo/a.py",
        "view_range": [1, 20],
    }
    assert result.calls[0].raw.startswith("<tool_call>\n{") and result.calls[0].raw.endswith(
        "</tool_call>"
    )
    assert result.errors == () and len(result.runnable) == 2
    assert len({c.id for c in result.calls}) == 2


def test_qwen_alias_parses_like_qwen25():
    assert parse(QWEN_TWO_CALLS, "qwen").calls == parse(QWEN_TWO_CALLS, "qwen25").calls


def test_qwen25_malformed_json_is_a_per_call_error_and_the_other_call_still_runs():
    text = (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>'
    )
    result = parse(text, "qwen25", reasoning=None)
    bad, good = result.calls
    assert bad.error is not None and bad.error.kind == "malformed"
    assert "invalid JSON" in bad.error.message
    assert bad.name == "bash" and bad.arguments is None
    assert good.ok and good.arguments == {"command": "pwd"}
    assert [e.kind for e in result.errors] == ["malformed"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('["bash"]', "expected a JSON object"),
        ('{"arguments": {}}', '"name" must be a non-empty string'),
        ('{"name": "bash", "arguments": [1]}', '"arguments" must be a JSON object'),
        ('{"name": "bash", "arguments": "ls"}', '"arguments" is a string that is not a JSON'),
    ],
)
def test_qwen25_structurally_wrong_calls_are_malformed(body, message):
    (call,) = parse(f"<tool_call>\n{body}\n</tool_call>", "qwen25").calls
    assert call.error is not None and call.error.kind == "malformed"
    assert message in call.error.message


def test_qwen25_arguments_given_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>'
    (call,) = parse(text, "qwen25").calls
    assert call.ok and call.arguments == {"command": "ls"}


def test_qwen25_call_cut_by_the_token_limit_is_truncated_not_malformed():
    text = 'Sure.\n<tool_call>\n{"name": "bash", "arguments": {"comm'
    truncated = parse(text, "qwen25", finish="length")
    (call,) = truncated.calls
    assert call.error is not None and call.error.kind == "truncated"
    assert call.name == "bash" and truncated.content == "Sure."
    # The same text ending on a stop token is a call the model never closed.
    (stopped,) = parse(text, "qwen25", finish="stop").calls
    assert stopped.error is not None and stopped.error.kind == "malformed"
    assert "not closed" in stopped.error.message


def test_qwen25_call_inside_reasoning_is_not_run():
    text = (
        '<think>\nMaybe <tool_call>\n{"name": "bash", "arguments": {"command": "rm -rf /"}}\n'
        "</tool_call> no.\n</think>\n\nI am done thinking."
    )
    result = parse(text, "qwen25")
    assert result.calls == ()
    assert [e.kind for e in result.errors] == ["in_reasoning"]
    assert "rm -rf" in result.errors[0].raw
    assert result.content == "I am done thinking."


def test_reply_that_ends_inside_reasoning_has_no_content_and_no_calls():
    result = parse("<think>\nStill thinking about <tool_call>", "qwen25", finish="length")
    assert result.reasoning_truncated and result.content == "" and result.calls == ()
    assert [e.kind for e in result.errors] == ["in_reasoning"]


def test_schema_check_flags_unknown_tools_and_bad_arguments():
    text = "".join(
        f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>\n'
        for name, args in [
            ("python", '{"code": "1"}'),
            ("bash", '{"timeout": 5}'),
            ("bash", '{"command": "ls", "cwd": "/"}'),
            ("bash", '{"command": "ls", "timeout": "5"}'),
            ("edit", '{"command": "delete", "path": "a"}'),
            ("edit", '{"command": "view", "path": "a", "view_range": [1, "x"]}'),
            ("bash", '{"command": "ls", "timeout": 5}'),
        ]
    )
    calls = parse(text, "qwen25").calls
    messages = [c.error.message if c.error else None for c in calls]
    assert [c.error.kind if c.error else None for c in calls] == [
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "bad_arguments",
        "bad_arguments",
        "bad_arguments",
        None,
    ]
    assert messages[0] == "unknown tool 'python' (tools: bash, edit)"
    assert messages[1] == "bash: missing required argument(s): command"
    assert messages[2] == "bash: unknown argument 'cwd' (takes: command, timeout)"
    assert messages[3] == "bash: argument 'timeout' must be integer, got string"
    assert messages[4] == "edit: argument 'command' must be one of view, create, got 'delete'"
    assert messages[5] == "edit: argument 'view_range' items must be integer, got string"


def test_reply_without_a_call_keeps_its_text_as_content():
    result = parse("<think>\nok\n</think>\n\nThe bug is in a.py.", "qwen25")
    assert result.calls == () and result.errors == ()
    assert result.content == "The bug is in a.py." and result.reasoning == "ok"


def test_qwen25_render_is_what_the_real_qwen3_template_writes_and_parses_back():
    tokenizer = load_tokenizer(bundled_qwen3_tokenizer_dir())
    arguments = {"command": "create", "path": "/r/x.py", "file_text": 'print("é")\n\tx = 1\n'}
    messages = [
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "edit", "arguments": arguments}}
            ],
        },
        {"role": "tool", "content": "created"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    fmt = get_tool_call_format("qwen25")
    assert fmt.render_call("edit", arguments) in rendered
    assistant = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    (call,) = parse(assistant, "qwen25").calls
    assert call.ok and call.name == "edit" and call.arguments == arguments


# ---- qwen3_coder: Qwen3-Coder XML --------------------------------------------------------

# Qwen3-Coder's model card: parameters as text, one per <parameter=...> tag, newline-padded.
CODER_TWO_CALLS = (
    "I will create the file, then run it.\n"
    "<tool_call>\n<function=edit>\n<parameter=command>\ncreate\n</parameter>\n"
    "<parameter=path>\n/repo/x.py\n</parameter>\n"
    "<parameter=file_text>\n\nif a < b and c > d:\n    print('&amp;')\n\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=bash>\n<parameter=command>\npython /repo/x.py\n</parameter>\n"
    "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_reads_two_calls_keeping_string_values_byte_exact():
    result = parse(CODER_TWO_CALLS, "qwen3_coder", reasoning=None)
    assert result.content == "I will create the file, then run it."
    edit, bash = result.calls
    assert edit.ok and edit.name == "edit"
    # One newline stripped each side (the template's padding); <, > and &amp; kept as written.
    assert edit.arguments == {
        "command": "create",
        "path": "/repo/x.py",
        "file_text": "\nif a < b and c > d:\n    print('&amp;')\n",
    }
    assert bash.ok and bash.arguments == {"command": "python /repo/x.py", "timeout": 30}


def test_qwen3_coder_string_parameter_that_looks_like_json_stays_a_string():
    text = (
        "<tool_call>\n<function=bash>\n<parameter=command>\n123\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    (call,) = parse(text, "qwen3_coder").calls
    assert call.ok and call.arguments == {"command": "123"}


def test_qwen3_coder_tolerates_missing_closing_tags_like_the_engines():
    text = "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</tool_call>"
    (call,) = parse(text, "qwen3_coder").calls
    assert call.ok and call.arguments == {"command": "ls"}


def test_qwen3_coder_block_without_function_tag_is_malformed():
    (call,) = parse("<tool_call>\nbash ls\n</tool_call>", "qwen3_coder").calls
    assert call.error is not None and call.error.kind == "malformed"
    assert "<function=NAME>" in call.error.message


def test_qwen3_coder_duplicate_parameter_and_stray_text_are_malformed():
    dup = (
        "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n"
        "<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>"
    )
    stray = (
        "<tool_call>\n<function=bash>\nrun this:\n<parameter=command>\nls\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    (dup_call,) = parse(dup, "qwen3_coder").calls
    (stray_call,) = parse(stray, "qwen3_coder").calls
    assert dup_call.error is not None and "given twice" in dup_call.error.message
    assert stray_call.error is not None and "text outside <parameter" in stray_call.error.message
    assert dup_call.name == stray_call.name == "bash"


def test_qwen3_coder_wrongly_typed_integer_is_a_bad_argument():
    text = (
        "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n"
        "<parameter=timeout>\nsoon\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = parse(text, "qwen3_coder").calls
    assert call.error is not None and call.error.kind == "bad_arguments"
    assert call.error.message == "bash: argument 'timeout' must be integer, got string"


def test_qwen3_coder_truncated_and_in_reasoning():
    cut = "<tool_call>\n<function=bash>\n<parameter=command>\nls -"
    (call,) = parse(cut, "qwen3_coder", finish="length").calls
    assert call.error is not None and call.error.kind == "truncated" and call.name == "bash"
    thought = "<think>\n<tool_call>\n<function=bash>\n</function>\n</tool_call>\n</think>\nDone."
    result = parse(thought, "qwen3_coder")
    assert result.calls == () and [e.kind for e in result.errors] == ["in_reasoning"]


def test_qwen3_coder_render_parses_back():
    fmt = get_tool_call_format("qwen3_coder")
    arguments = {"command": "create", "path": "/a", "file_text": "x\n<y>\n"}
    (call,) = parse(fmt.render_call("edit", arguments), "qwen3_coder").calls
    assert call.ok and call.arguments == arguments


# ---- glm45 / glm47 -------------------------------------------------------------------------

# GLM-4.5's template: the name, then <arg_key>/<arg_value> pairs, one per line; non-string
# values as JSON. GLM-4.7's: the same pairs with no newlines.
GLM45_CALL = (
    "<think>The file first.</think>\n"
    "<tool_call>edit\n<arg_key>command</arg_key>\n<arg_value>view</arg_value>\n"
    "<arg_key>path</arg_key>\n<arg_value>/repo/a.py</arg_value>\n"
    "<arg_key>view_range</arg_key>\n<arg_value>[3, 9]</arg_value>\n</tool_call>"
)
GLM47_CALLS = (
    "<tool_call>bash<arg_key>command</arg_key><arg_value>ls</arg_value>"
    "<arg_key>timeout</arg_key><arg_value>5</arg_value></tool_call>"
    "<tool_call>bash<arg_key>command</arg_key><arg_value>[1, 2]</arg_value></tool_call>"
)


def test_glm45_reads_name_and_typed_arguments_after_reasoning():
    result = parse(GLM45_CALL, "glm45", reasoning="glm45")
    assert result.reasoning == "The file first."
    (call,) = result.calls
    assert call.ok and call.name == "edit"
    assert call.arguments == {"command": "view", "path": "/repo/a.py", "view_range": [3, 9]}
    assert parse(GLM45_CALL, "glm", reasoning="glm45").calls == result.calls


def test_glm47_reads_calls_without_newlines_and_keeps_string_values_as_text():
    first, second = parse(GLM47_CALLS, "glm47", reasoning="glm45").calls
    assert first.ok and first.arguments == {"command": "ls", "timeout": 5}
    # `command` is declared a string: "[1, 2]" stays the text the model wrote.
    assert second.ok and second.arguments == {"command": "[1, 2]"}


def test_glm_missing_name_or_unpaired_key_is_malformed():
    no_name = "<tool_call><arg_key>command</arg_key><arg_value>ls</arg_value></tool_call>"
    unpaired = "<tool_call>bash<arg_key>command</arg_key></tool_call>"
    (a,) = parse(no_name, "glm47").calls
    (b,) = parse(unpaired, "glm47").calls
    assert a.error is not None and "tool name right after <tool_call>" in a.error.message
    assert b.error is not None and "<arg_key> without its <arg_value>" in b.error.message
    assert b.name == "bash"


def test_glm_truncated_call():
    (call,) = parse("<tool_call>bash<arg_key>comm", "glm47", finish="length").calls
    assert call.error is not None and call.error.kind == "truncated"


@pytest.mark.parametrize("name", ["glm45", "glm47"])
def test_glm_render_parses_back(name):
    fmt = get_tool_call_format(name)
    arguments = {"command": "view", "path": "/a b", "view_range": [1, 2]}
    rendered = fmt.render_call("edit", arguments)
    assert ("\n" in rendered) is (name == "glm45")
    (call,) = parse(rendered, name).calls
    assert call.ok and call.arguments == arguments


# ---- reasoning parsers ---------------------------------------------------------------------


def test_qwen3_reasoning_without_opening_tag_still_splits():
    # Newer Qwen3 templates open <think> in the generation prompt; the reply has only </think>.
    split = get_reasoning_parser("qwen3").split("plan it\n</think>\n\nanswer")
    assert split.reasoning == "plan it" and split.content == "\n\nanswer" and not split.truncated


def test_qwen3_reply_without_think_is_all_content():
    split = get_reasoning_parser("qwen3").split("just an answer")
    assert split.reasoning is None and split.content == "just an answer"


def test_forced_reasoning_parsers_read_an_unclosed_reply_as_truncated_reasoning():
    for name in ("qwen3-thinking", "deepseek-r1"):
        split = get_reasoning_parser(name).split("thinking and thinking")
        assert split.reasoning == "thinking and thinking" and split.content == ""
        assert split.truncated
