"""swerl's incremental chat-template rendering beside miles' TITO tokenizers, token for token.

testkit/tito_driver.py plays miles' mock trajectories through miles' own TITO tokenizers and
fixed Qwen3 templates (`miles-tito-tokenizers`, from SWERL_TITO_SITE); this module plays the same
sessions through swerl's two incremental paths over the same template and tokenizer:

- the model gateway's (`swerl.agent.gateway.render.Renderer`): `full` for the first prompt,
  then per turn the recorded prompt, the sampled ids and `delta(new messages)`;
- the episode loop's (`swerl.agent.policy.tokens.ChatCodec.messages_delta`) after the same
  first prompt.

tests/agent/test_tito.py asserts each prompt equals TITO's; docs/tito.md says what is compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swerl.agent.gateway.render import Renderer
from swerl.agent.policy.tokens import ChatCodec
from swerl.chassis.hf import bundled_qwen3_tokenizer_dir

DRIVER_PATH = Path(__file__).resolve().with_name("tito_driver.py")


def run_tito(site: str, timeout_s: float = 300) -> dict[str, Any]:
    """TITO's prompts for every family and trajectory, from one run of the driver with `site`
    (a `pip install --target` directory holding miles-tito-tokenizers) on its PYTHONPATH."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, str(DRIVER_PATH), str(bundled_qwen3_tokenizer_dir())],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the TITO driver failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def tito_importable(site: str) -> bool:
    env = {**os.environ, "PYTHONPATH": site}
    probe = subprocess.run(
        [sys.executable, "-c", "import miles_tito_tokenizers"], env=env, capture_output=True
    )
    return probe.returncode == 0


def _tokenizer(template_text: str) -> Any:
    """The bundled Qwen3 tokenizer with `template_text` as its chat template (a copy of its own:
    swerl's cached tokenizer is shared)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(bundled_qwen3_tokenizer_dir()), local_files_only=True
    )
    tokenizer.chat_template = template_text
    return tokenizer


@dataclass(frozen=True)
class Session:
    """One trajectory's prompts, turn by turn: TITO's and swerl's two paths."""

    family: str
    name: str
    tito: list[list[int]]
    gateway: list[list[int]]
    episode: list[list[int]]
    full: list[list[int]]  # the whole conversation rendered again at each turn (not TITO)


def swerl_sessions(family: dict[str, Any]) -> list[Session]:
    tokenizer = _tokenizer(family["template_text"])
    # One renderer per set of template arguments, as the gateway keeps one per policy.
    renderers: dict[str, Renderer] = {}
    sessions = []
    for trajectory in family["trajectories"]:
        tools = trajectory["tools"]
        kwargs = trajectory["template_kwargs"]
        codec = ChatCodec(tokenizer, {**kwargs, "tools": tools})
        key = json.dumps(kwargs, sort_keys=True)
        if key not in renderers:
            renderers[key] = Renderer(ChatCodec(tokenizer, kwargs))
        renderer = renderers[key]
        gateway: list[list[int]] = []
        episode: list[list[int]] = []
        seen = 0
        for number, turn in enumerate(trajectory["turns"]):
            messages = turn["request_messages"]
            if number == 0:
                first = renderer.full(messages, tools)
                gateway.append(first)
                episode.append(list(first))
            else:
                sampled = trajectory["turns"][number - 1]["response_ids"]
                new = messages[seen + 1 :]  # after the previous request and its assistant turn
                gateway.append(gateway[-1] + sampled + renderer.delta(new, output_ended=True))
                episode.append(episode[-1] + sampled + codec.messages_delta(sampled, new))
            seen = len(messages)
        sessions.append(
            Session(
                family=family["tokenizer"],
                name=trajectory["name"],
                tito=[turn["tito_prompt_ids"] for turn in trajectory["turns"]],
                gateway=gateway,
                episode=episode,
                full=[turn["full_prompt_ids"] for turn in trajectory["turns"]],
            )
        )
    return sessions
