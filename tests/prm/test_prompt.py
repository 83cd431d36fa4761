"""The judge's prompt: what is kept, what is cut, and in which order."""

from __future__ import annotations

from testkit.prm import make_step

from swerl.prm.prompt import HistoryStep, PromptLimits, build_messages, cut_middle


def user_text(step, limits: PromptLimits | None = None) -> str:
    messages = build_messages(step, limits or PromptLimits())
    assert [m["role"] for m in messages] == ["system", "user"]
    return messages[1]["content"]


def test_cut_middle_keeps_head_and_tail_and_says_how_much_went():
    text = "a" * 50 + "b" * 50
    cut = cut_middle(text, 20)
    assert cut.startswith("a" * 10)
    assert cut.endswith("b" * 10)
    assert "(80 characters omitted)" in cut
    assert cut_middle("short", 20) == "short"


def test_the_issue_is_cut_to_its_limit():
    text = user_text(make_step(issue="x" * 10_000), PromptLimits(max_issue_chars=100))
    assert "x" * 50 in text
    assert "x" * 51 not in text
    assert "(9900 characters omitted)" in text


def test_only_the_last_n_history_steps_are_shown_with_exit_codes_and_output_ends():
    history = tuple(
        HistoryStep(
            action=f"cmd-{i}", exit_code=i, output_head=f"head-{i}", output_tail=f"tail-{i}"
        )
        for i in range(10)
    )
    text = user_text(make_step(history=history, step_index=10), PromptLimits(history_steps=3))

    assert "the last 3 of 10" in text
    assert "cmd-6" not in text
    for i in (7, 8, 9):
        assert f"Step {i}: $ cmd-{i}" in text
        assert f"exit code: {i}" in text
        assert f"head-{i}" in text and f"tail-{i}" in text


def test_a_format_error_in_the_history_says_nothing_ran():
    history = (HistoryStep(action="", exit_code=0, format_error=True),)
    text = user_text(make_step(history=history, step_index=1))
    assert "Step 0: (format error" in text


def test_the_judged_step_shows_the_full_response_and_its_result():
    response = "I will look at the function first.\n```bash\ncat core.py\n```"
    step = make_step("cat core.py", response=response, exit_code=3, output="No such file")
    text = user_text(step)

    assert response in text
    assert "Exit code: 3" in text
    assert "No such file" in text
    assert text.index("## Issue") < text.index("## Recent steps") < text.index("## Step to judge")


def test_a_long_step_output_keeps_its_head_and_tail():
    output = "HEAD" + "." * 10_000 + "TAIL"
    text = user_text(make_step(output=output), PromptLimits(step_output_chars=200))
    assert "HEAD" in text and "TAIL" in text
    assert "characters omitted" in text
