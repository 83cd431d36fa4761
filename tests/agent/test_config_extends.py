"""Agent configs that extend another (`extends:` a shipped config's name or a path): the parent's
mapping merged under the child's (mappings key by key, the child winning; lists replaced), and
the refusals of a chain that comes back to itself or names no config (UNKNOWN_AGENT_CONFIG, an
INVALID_ARGUMENT at the episode's start).

The shipped `tools` config keeps only what differs from `default`; loaded, it is exactly the
config it was when it repeated all of `default` (snapshots/tools_config_a266cf0.yaml, the file
as it was then)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from swerl.agent import config as config_module
from swerl.agent.config import AgentConfig, config_mapping, deep_merge, load_config
from swerl.agent.errors import UnknownConfig

SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "tools_config_a266cf0.yaml"


def _comparable(config: AgentConfig) -> dict[str, object]:
    """A loaded config's fields, each template as the text it renders for fixed values."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields.pop("name")
    templates = fields.pop("templates")
    values = {
        "task": "T",
        "instance": {},
        "returncode": 0,
        "output": "x" * 12000,
        "timed_out": True,
        "timeout_s": 5,
        "turns_left": 1,
        "n_omitted": 2,
        "n_blocks": 0,
        "error": "E",
        "in_reasoning": 1,
    }
    fields["templates"] = {key: config.render(key, **values) for key in sorted(templates)}
    return fields


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(config_module, "CONFIG_DIR", tmp_path)
    load_config.cache_clear()
    yield tmp_path
    load_config.cache_clear()


def test_the_tools_config_loads_exactly_as_its_fully_written_form_did(config_dir):
    shipped = Path(config_module.__file__).resolve().parent / "configs"
    tools = (shipped / "tools.yaml").read_text()
    assert yaml.safe_load(tools)["extends"] == "default"
    # The mapping the config is built from is the whole file as it was.
    (config_dir / "default.yaml").write_text((shipped / "default.yaml").read_text())
    (config_dir / "tools.yaml").write_text(tools)
    (config_dir / "snapshot.yaml").write_text(SNAPSHOT.read_text())
    assert config_mapping("tools") == yaml.safe_load(SNAPSHOT.read_text())
    # And so is what is loaded from it: every field, every template's rendering.
    assert _comparable(load_config("tools")) == _comparable(load_config("snapshot"))


def test_a_child_wins_key_by_key_in_mappings_and_replaces_lists(config_dir):
    (config_dir / "base.yaml").write_text(
        yaml.safe_dump(
            {
                "env": {"PAGER": "cat", "LESS": "-R"},
                "tools": ["bash", "submit"],
                "defaults": {"max_turns": 50, "wall_timeout_s": 3600},
                "workdir": "/testbed",
            }
        )
    )
    (config_dir / "child.yaml").write_text(
        yaml.safe_dump(
            {
                "extends": "base",
                "env": {"LESS": "-S", "TERM": "dumb"},
                "tools": ["bash"],
                "defaults": {"max_turns": 10},
            }
        )
    )
    assert config_mapping("child") == {
        "env": {"PAGER": "cat", "LESS": "-S", "TERM": "dumb"},
        "tools": ["bash"],
        "defaults": {"max_turns": 10, "wall_timeout_s": 3600},
        "workdir": "/testbed",
    }
    # A config three deep: each level over the one below.
    (config_dir / "grandchild.yaml").write_text("extends: child\ndefaults: {wall_timeout_s: 60}\n")
    assert config_mapping("grandchild")["defaults"] == {"max_turns": 10, "wall_timeout_s": 60}
    assert deep_merge({"a": {"b": 1}}, {"a": 2}) == {"a": 2}


def test_a_parent_named_by_path_is_read_from_the_childs_folder(config_dir, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "base.yaml").write_text("workdir: /repo\nenv: {A: '1'}\n")
    (config_dir / "sub").mkdir()
    (config_dir / "sub" / "base.yaml").write_text("workdir: /sub\n")
    (config_dir / "relative.yaml").write_text("extends: sub/base.yaml\nenv: {B: '2'}\n")
    (config_dir / "absolute.yaml").write_text(f"extends: {elsewhere / 'base.yaml'}\n")
    assert config_mapping("relative") == {"workdir": "/sub", "env": {"B": "2"}}
    assert config_mapping("absolute") == {"workdir": "/repo", "env": {"A": "1"}}


def _refused(name: str) -> UnknownConfig:
    with pytest.raises(UnknownConfig) as caught:
        load_config(name)
    assert caught.value.code == "INVALID_ARGUMENT"
    assert caught.value.reason == "UNKNOWN_AGENT_CONFIG"
    assert caught.value.metadata == {"config_name": name}
    return caught.value


def test_an_extends_cycle_is_refused_naming_the_chain(config_dir):
    (config_dir / "a.yaml").write_text("extends: b\n")
    (config_dir / "b.yaml").write_text("extends: ./a.yaml\n")
    (config_dir / "self.yaml").write_text("extends: self\n")
    assert str(_refused("a")) == "agent config 'a': extends cycle a.yaml -> b.yaml -> a.yaml"
    assert str(_refused("self")) == "agent config 'self': extends cycle self.yaml -> self.yaml"


def test_an_unknown_parent_is_refused_naming_it(config_dir):
    (config_dir / "orphan.yaml").write_text("extends: nowhere\n")
    (config_dir / "lost.yaml").write_text("extends: missing/base.yaml\n")
    (config_dir / "odd.yaml").write_text("extends: [default]\n")
    (config_dir / "list.yaml").write_text("- extends\n")
    assert str(_refused("orphan")) == (
        "agent config 'orphan': orphan.yaml extends 'nowhere', but no agent config has that name"
    )
    assert str(_refused("lost")) == (
        "agent config 'lost': lost.yaml extends 'missing/base.yaml', but there is no file"
        f" {config_dir / 'missing' / 'base.yaml'}"
    )
    assert str(_refused("odd")) == (
        "agent config 'odd': odd.yaml extends ['default'], which is not a config name or a path"
    )
    assert str(_refused("list")) == "agent config 'list': list.yaml is not a YAML mapping"
    # A parent's own broken chain is refused in the name of the config asked for.
    (config_dir / "child.yaml").write_text("extends: orphan\n")
    assert "agent config 'child': orphan.yaml extends 'nowhere'" in str(_refused("child"))
