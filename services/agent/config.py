"""Agent configs: the prompt templates, command environment and default limits, by name.

A config is a YAML file shipped in `swerl/agent/configs/<name>.yaml` (EpisodeOptions.config_name;
empty means "default"). Templates are Jinja2 with StrictUndefined, compiled once per config.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from swerl.agent.errors import UnknownConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_TEMPLATES = (
    "system_template",
    "instance_template",
    "observation_template",
    "format_error_template",
    "omission_template",
)


@dataclass(frozen=True)
class Defaults:
    max_turns: int
    max_context_tokens: int
    max_new_tokens: int
    wall_timeout_s: float
    command_timeout_s: float
    eval_timeout_s: float


@dataclass(frozen=True)
class AgentConfig:
    name: str
    templates: dict[str, jinja2.Template]
    max_output_chars: int
    head_chars: int
    tail_chars: int
    turns_left_warning: int
    env: dict[str, str]
    workdir: str
    chat_template_kwargs: dict[str, Any]
    defaults: Defaults

    def render(self, template: str, **values: Any) -> str:
        context = {
            "sentinel": SUBMIT_SENTINEL,
            "workdir": self.workdir,
            "max_output_chars": self.max_output_chars,
            "head_chars": self.head_chars,
            "tail_chars": self.tail_chars,
            "turns_left_warning": self.turns_left_warning,
            **values,
        }
        return self.templates[template].render(**context)


@functools.lru_cache(maxsize=16)
def load_config(name: str = "") -> AgentConfig:
    """The named config; raises UnknownConfig for a name that is not shipped."""
    name = name or "default"
    path = CONFIG_DIR / f"{name}.yaml"
    if not _NAME.match(name) or not path.is_file():
        raise UnknownConfig(f"no agent config named {name!r}", config_name=name)
    raw = yaml.safe_load(path.read_text())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False)
    return AgentConfig(
        name=name,
        templates={key: env.from_string(raw[key]) for key in _TEMPLATES},
        max_output_chars=int(raw["max_output_chars"]),
        head_chars=int(raw["head_chars"]),
        tail_chars=int(raw["tail_chars"]),
        turns_left_warning=int(raw.get("turns_left_warning", 0)),
        env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
        workdir=str(raw.get("workdir", "/testbed")),
        chat_template_kwargs=dict(raw.get("chat_template_kwargs") or {}),
        defaults=Defaults(**raw["defaults"]),
    )
