"""The judge's prompt: what the PRM model reads about one agent step.

The prompt is chat messages (system + user), so each backend renders it with the judge model's
own chat template: the SGLang backend with the judge's tokenizer, the OpenAI backend on the
server. It holds the issue (cut to a length), the last few steps (command, exit code, the head
and tail of their output), and the step being judged in full: the policy's whole response, the
command's exit code and output (cut to a head and a tail with an elision note).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

SYSTEM_PROMPT = """\
You judge single steps of a software engineering agent that is fixing a GitHub issue in a \
repository. Each step, the agent writes its reasoning and exactly one bash command, and the \
command runs in the repository's sandbox.

You get the issue, the agent's recent steps, and the step to judge with its execution result.

Answer +1 when all of these hold:
- the command ran as intended (no unexpected error, wrong path or syntax error);
- the step clearly moves the diagnosis or the fix of the issue forward;
- its output is useful, or its edit is correct.

Answer -1 when any of these holds:
- the command failed or did something other than intended;
- the step is irrelevant to the issue;
- the step repeats an approach that already failed, or re-reads what was already read;
- the edit introduces a bug.

Reason briefly, then give your verdict on the last line as \\boxed{+1} or \\boxed{-1}."""


@dataclass(frozen=True)
class HistoryStep:
    """An earlier step, as context: its command, exit code and the ends of its output."""

    action: str
    exit_code: int
    output_head: str = ""
    output_tail: str = ""
    format_error: bool = False


@dataclass(frozen=True)
class CurrentStep:
    """The step to judge: the policy's whole response, its command and what the command did."""

    response: str
    action: str
    exit_code: int
    output: str


@dataclass(frozen=True)
class StepToJudge:
    """Everything the judge is told about one step, plus where the step sits (for seeds)."""

    episode_id: str
    step_index: int
    issue: str
    history: tuple[HistoryStep, ...]
    step: CurrentStep


@dataclass(frozen=True)
class PromptLimits:
    """How much of each part the prompt keeps, in characters (steps for `history_steps`)."""

    max_issue_chars: int = 8000
    history_steps: int = 8
    history_output_chars: int = 1000
    step_output_chars: int = 4000
    step_response_chars: int = 16000

    def halved(self) -> PromptLimits:
        """Tighter limits, for a prompt that came out longer than the judge's context allows."""
        return replace(
            self,
            max_issue_chars=self.max_issue_chars // 2,
            history_steps=self.history_steps // 2,
            history_output_chars=self.history_output_chars // 2,
            step_output_chars=self.step_output_chars // 2,
            step_response_chars=self.step_response_chars // 2,
        )


def cut_middle(text: str, limit: int) -> str:
    """`text` if it fits in `limit` characters, else its head and tail around an elision note."""
    if len(text) <= limit:
        return text
    if limit <= 0:
        return f"... ({len(text)} characters omitted) ..."
    head = limit // 2
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n... ({omitted} characters omitted) ...\n{text[len(text) - tail :]}"


def join_head_tail(head: str, tail: str, limit: int) -> str:
    """A history step's output from the head and tail the client kept, within `limit`."""
    text = head if not tail else f"{head}\n...\n{tail}"
    return cut_middle(text, limit)


def _history_block(history: Sequence[HistoryStep], first_number: int, limits: PromptLimits) -> str:
    if not history:
        return "(none: this is the first step)" if first_number <= 0 else "(not shown)"
    lines = []
    for number, step in enumerate(history, start=first_number):
        if step.format_error:
            lines.append(f"Step {number}: (format error: no single bash command, nothing ran)")
            continue
        output = join_head_tail(step.output_head, step.output_tail, limits.history_output_chars)
        lines.append(f"Step {number}: $ {step.action}\n  exit code: {step.exit_code}")
        lines.append("  output:\n" + _indent(output.strip() or "(no output)", "    "))
    return "\n".join(lines)


def _history_header(shown: int, total: int) -> str:
    if shown < total:
        return f"## Recent steps (the last {shown} of {total})\n"
    return "## Recent steps\n"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def build_messages(step: StepToJudge, limits: PromptLimits) -> list[dict[str, str]]:
    """The judge's chat messages for `step` under `limits`."""
    shown = step.history[-limits.history_steps :] if limits.history_steps > 0 else ()
    first_number = step.step_index - len(shown)
    current = step.step
    user = "\n\n".join(
        [
            "## Issue\n" + cut_middle(step.issue.strip(), limits.max_issue_chars),
            _history_header(len(shown), len(step.history))
            + _history_block(shown, max(first_number, 0), limits),
            f"## Step to judge (step {step.step_index})\n"
            "Agent's full response:\n" + cut_middle(current.response, limits.step_response_chars),
            f"Command: $ {current.action}\n"
            f"Exit code: {current.exit_code}\n"
            "Output:\n" + (cut_middle(current.output, limits.step_output_chars) or "(no output)"),
            "Is this step good (\\boxed{+1}) or bad (\\boxed{-1})?",
        ]
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
