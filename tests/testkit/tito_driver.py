"""Runs miles' own TITO (token-in-token-out) tokenizers over miles' own mock trajectories and
prints, per trajectory and turn, the prompt ids TITO builds; testkit.tito_parity compares them
with swerl's incremental rendering.

miles' package (`miles-tito-tokenizers`) is not a swerl dependency: scripts/test installs it with
`pip install --target` into a directory of its own (SWERL_TITO_SITE), and this file runs in a
subprocess with that directory on its PYTHONPATH, as the Ray tests load Ray.

For each of TITO's Qwen3-tokenizer families (its tokenizer class and its fixed template) and each
mock trajectory whose appended roles one of the family's template rows allows (`SUPPORTED_
TEMPLATES`), a session is played as a trainer plays it: the first prompt is the template's
rendering; each turn's response is the assistant message's rendering (`build_trajectory`) as the
engine samples it, ending at `<|im_end|>`; the next prompt is `merge_tokens(previous messages,
new messages, previous prompt + response)`.

    argv[1]: the tokenizer directory
    stdout:  {"families": [{"tokenizer": CLASS, "template": FILE, "template_text": TEXT,
              "trajectories": [{"name", "template_kwargs", "tools", "turns": [{"request_messages",
              "response_ids", "tito_prompt_ids", "full_prompt_ids"}]}], "unsupported": [NAME]}]}
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

# Run as a script, this file's folder (tests/testkit) is first on sys.path, and a module of the
# testkit could shadow the package it drives (`import miles_tito_tokenizers`): only the
# interpreter's own paths.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

FAMILIES = (
    ("Qwen3TITOTokenizer", "qwen3_fixed.jinja"),
    ("QwenNextTITOTokenizer", "qwen3_thinking_2507_and_next_fixed.jinja"),
    ("Qwen35TITOTokenizer", "qwen3.5_fixed.jinja"),
)


def _trajectory_classes() -> list[type]:
    from miles_tito_tokenizers.testing import mock_trajectories

    return [
        value
        for name, value in vars(mock_trajectories).items()
        if name.endswith("Trajectory") and isinstance(value, type) and hasattr(value, "MESSAGES")
    ]


def _play(tito: Any, tokenizer: Any, trajectory: Any) -> list[dict[str, Any]]:
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tools = trajectory.tools
    turns: list[dict[str, Any]] = []
    prompt: list[int] = []
    previous: list[dict[str, Any]] = []
    sampled: list[int] = []  # the previous prompt and its response, as the trainer holds them
    for number, turn in enumerate(trajectory.turns):
        if number == 0:
            prompt = tito.render_messages(
                turn.request_messages, add_generation_prompt=True, tools=tools, tokenize=True
            )
        else:
            prompt = tito.merge_tokens(previous, turn.request_messages, sampled, tools)
        full = tito.render_messages(
            turn.request_messages, add_generation_prompt=True, tools=tools, tokenize=True
        )
        # What the engine samples: the assistant turn up to and with its end-of-turn token (the
        # template's newline after it is the next message's business).
        response = tokenizer.encode(turn.response_text.removesuffix("\n"), add_special_tokens=False)
        assert response[-1] == end_of_turn, "a mock response that does not end its turn"
        turns.append(
            {
                "request_messages": turn.request_messages,
                "response_ids": response,
                "tito_prompt_ids": list(prompt),
                "full_prompt_ids": list(full),
            }
        )
        sampled = list(prompt) + response
        previous = [*turn.request_messages, turn.assistant_message]
    return turns


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from miles_tito_tokenizers import TEMPLATE_DIR
    from miles_tito_tokenizers import tokenizer as tito_tokenizers
    from miles_tito_tokenizers.testing.mock_trajectories import build_trajectory
    from transformers import AutoTokenizer

    families = []
    for class_name, template_file in FAMILIES:
        tito_cls = getattr(tito_tokenizers, class_name)
        template_text = (TEMPLATE_DIR / template_file).read_text()
        tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
        tokenizer.chat_template = template_text
        played = []
        unsupported = []
        for trajectory_cls in _trajectory_classes():
            rows = [
                row
                for row in tito_cls.SUPPORTED_TEMPLATES
                if row.template == template_file
                and trajectory_cls.APPEND_ROLES <= row.allowed_roles
            ]
            if not rows:
                unsupported.append(trajectory_cls.__name__)
                continue
            kwargs = dict(rows[0].extra_kwargs)
            tito = tito_cls(
                tokenizer,
                chat_template_kwargs=kwargs,
                allowed_append_roles=sorted(trajectory_cls.APPEND_ROLES),
            )
            trajectory = build_trajectory(tokenizer, trajectory_cls, chat_template=None)
            played.append(
                {
                    "name": trajectory_cls.__name__,
                    "template_kwargs": kwargs,
                    "tools": trajectory.tools,
                    "turns": _play(tito, tokenizer, trajectory),
                }
            )
        families.append(
            {
                "tokenizer": class_name,
                "template": template_file,
                "template_text": template_text,
                "trajectories": played,
                "unsupported": unsupported,
            }
        )
    json.dump({"families": families}, sys.stdout)


if __name__ == "__main__":
    main()
