"""Agent configs: the prompt templates, command environment and default limits, by name.

A config is a YAML file shipped in `services/agent/configs/<name>.yaml`, installed as
`swerl/agent/configs/` (EpisodeOptions.config_name; empty means "default"). Templates are Jinja2
with StrictUndefined, compiled once per config.

A config may start from another: `extends: <name>` (a shipped config) or `extends: <path>` (a
YAML file; a relative path is read from the extending file's folder; a path is anything with a
`/` or a `.yaml`/`.yml` ending). The parent's mapping is merged under the child's: mappings merge
key by key, recursively, and the child's value wins; a list or a scalar is replaced whole. A
chain that comes back to a file already in it, or names a parent that does not exist, is refused
(UnknownConfig). So a config holds only what differs from the one it extends (`tools` extends
`default`).
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
# Templates only the `tool_calls` protocol uses: the tool message of a call the agent could not
# run (`error`), and the user message after a reply that called no tool.
_TOOL_TEMPLATES = ("tool_error_template", "no_call_template")
ACTION_PROTOCOLS = ("bash_block", "tool_calls")
# The key naming the config a config extends (read and removed before the merge).
EXTENDS_KEY = "extends"


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
    # `bash_block` (one ```bash block per reply) or `tool_calls` (the model's native tool calls).
    action_protocol: str = "bash_block"
    # tool_calls: the tools' JSON schemas in the chat API's shape, given to the chat template.
    tools: tuple[dict[str, Any], ...] = ()
    # tool_calls: SGLang's --tool-call-parser / --reasoning-parser names for the policy model.
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    # tool_calls: a reply whose calls all failed counts as a format error; this many in a row
    # end the episode FORMAT_ERRORS-limited (0: only the turn limit applies).
    max_format_errors: int = 0
    # Earlier turns' reasoning in later prompts: `keep` (as sampled: one token chain) or `drop`
    # (left out, as Qwen3's template does before the last user message: a new chain each turn
    # whose reply had reasoning).
    history_reasoning: str = "keep"

    @property
    def tool_calls(self) -> bool:
        return self.action_protocol == "tool_calls"

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's keyword arguments: the config's, plus the tools to declare."""
        if not self.tool_calls:
            return dict(self.chat_template_kwargs)
        return {**self.chat_template_kwargs, "tools": [dict(tool) for tool in self.tools]}

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
    raw = config_mapping(name)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False)
    protocol = str(raw.get("action_protocol", "bash_block"))
    if protocol not in ACTION_PROTOCOLS:
        raise UnknownConfig(
            f"agent config {name!r}: action_protocol {protocol!r} is not one of"
            f" {', '.join(ACTION_PROTOCOLS)}",
            config_name=name,
        )
    tools: tuple[dict[str, Any], ...] = ()
    if protocol == "tool_calls":
        tools = _tool_schemas(name, raw.get("tools") or [])
        _check_parsers(name, str(raw.get("tool_call_parser", "")), raw.get("reasoning_parser"))
    templates = {key: env.from_string(raw[key]) for key in _TEMPLATES}
    templates.update({key: env.from_string(raw[key]) for key in _TOOL_TEMPLATES if key in raw})
    return AgentConfig(
        name=name,
        templates=templates,
        max_output_chars=int(raw["max_output_chars"]),
        head_chars=int(raw["head_chars"]),
        tail_chars=int(raw["tail_chars"]),
        turns_left_warning=int(raw.get("turns_left_warning", 0)),
        env={str(k): str(v) for k, v in (raw.get("env") or {}).items()},
        workdir=str(raw.get("workdir", "/testbed")),
        chat_template_kwargs=dict(raw.get("chat_template_kwargs") or {}),
        defaults=Defaults(**raw["defaults"]),
        action_protocol=protocol,
        tools=tools,
        tool_call_parser=str(raw.get("tool_call_parser", "")),
        reasoning_parser=str(raw.get("reasoning_parser") or ""),
        max_format_errors=int(raw.get("max_format_errors", 0)),
        history_reasoning=_history_reasoning(name, raw.get("history_reasoning", "keep")),
    )


def config_mapping(name: str = "") -> dict[str, Any]:
    """The named config's YAML as one mapping, its `extends:` chain merged in (the parents'
    values under the child's); raises UnknownConfig for a name that is not shipped, a parent
    that does not exist and a chain that comes back to itself."""
    name = name or "default"
    path = CONFIG_DIR / f"{name}.yaml"
    if not _NAME.match(name) or not path.is_file():
        raise UnknownConfig(f"no agent config named {name!r}", config_name=name)
    return _expanded(name, path, ())


def _expanded(name: str, path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """The mapping of the config file `path` with its parents merged in; `chain` holds the
    files that extend it, child first."""
    here = path.resolve()
    if here in chain:
        files = " -> ".join(p.name for p in (*chain, here))
        raise UnknownConfig(f"agent config {name!r}: extends cycle {files}", config_name=name)
    raw = yaml.safe_load(path.read_text())
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UnknownConfig(
            f"agent config {name!r}: {path.name} is not a YAML mapping", config_name=name
        )
    if EXTENDS_KEY not in raw:
        return raw
    parent = raw.pop(EXTENDS_KEY)
    parent_path = _parent_path(name, path, parent)
    return deep_merge(_expanded(name, parent_path, (*chain, here)), raw)


def _parent_path(name: str, child: Path, parent: object) -> Path:
    """The file `extends: <parent>` in the config file `child` names: a shipped config by name,
    else a path (a relative one from the child's folder)."""
    if not isinstance(parent, str) or not parent:
        raise UnknownConfig(
            f"agent config {name!r}: {child.name} extends {parent!r}, which is not a config"
            " name or a path",
            config_name=name,
        )
    if "/" in parent or parent.endswith((".yaml", ".yml")):
        path = Path(parent).expanduser()
        path = path if path.is_absolute() else child.parent / path
        if path.is_file():
            return path
        raise UnknownConfig(
            f"agent config {name!r}: {child.name} extends {parent!r}, but there is no file {path}",
            config_name=name,
        )
    path = CONFIG_DIR / f"{parent}.yaml"
    if _NAME.match(parent) and path.is_file():
        return path
    raise UnknownConfig(
        f"agent config {name!r}: {child.name} extends {parent!r}, but no agent config has that"
        " name",
        config_name=name,
    )


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`: mappings in both merge key by key (recursively), anything else
    (a list, a scalar, a mapping over a non-mapping) is `override`'s. Neither is changed."""
    merged = dict(base)
    for key, value in override.items():
        below = merged.get(key)
        if isinstance(value, dict) and isinstance(below, dict):
            merged[key] = deep_merge(below, value)
        else:
            merged[key] = value
    return merged


def _history_reasoning(name: str, value: object) -> str:
    if value not in ("keep", "drop"):
        raise UnknownConfig(
            f"agent config {name!r}: history_reasoning {value!r} is not keep or drop",
            config_name=name,
        )
    return str(value)


def _tool_schemas(name: str, names: list[Any]) -> tuple[dict[str, Any], ...]:
    from swerl.agent.actions.tool_set import TOOLS

    unknown = [str(tool) for tool in names if tool not in TOOLS]
    if unknown or not names:
        raise UnknownConfig(
            f"agent config {name!r}: tools {unknown or '(none)'} are not among {', '.join(TOOLS)}",
            config_name=name,
        )
    return tuple(TOOLS[str(tool)] for tool in names)


def _check_parsers(name: str, tool_call_parser: str, reasoning: object) -> None:
    from swerl.agent.actions.toolcalls import (
        UnknownParserError,
        get_reasoning_parser,
        get_tool_call_format,
    )

    try:
        get_tool_call_format(tool_call_parser)
        if reasoning:
            get_reasoning_parser(str(reasoning))
    except UnknownParserError as err:
        raise UnknownConfig(f"agent config {name!r}: {err}", config_name=name) from None
