"""Agent configs of the tool_calls protocol: the shipped `tools` config and the refusals of a
config that names a protocol, a tool or a parser swerl does not have (UNKNOWN_AGENT_CONFIG, an
INVALID_ARGUMENT at the episode's start)."""

from __future__ import annotations

import pytest
import yaml

from swerl.agent import config as config_module
from swerl.agent.config import load_config
from swerl.agent.errors import UnknownConfig


def test_the_shipped_tools_config_declares_three_tools_and_qwen3s_parsers():
    config = load_config("tools")
    assert config.tool_calls and config.action_protocol == "tool_calls"
    assert [t["function"]["name"] for t in config.tools] == ["bash", "str_replace_editor", "submit"]
    assert (config.tool_call_parser, config.reasoning_parser) == ("qwen25", "qwen3")
    assert config.template_kwargs()["tools"][0]["function"]["name"] == "bash"
    default = load_config("default")
    assert not default.tool_calls and "tools" not in default.template_kwargs()


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    shipped = config_module.config_mapping("tools")  # its `extends:` merged in
    monkeypatch.setattr(config_module, "CONFIG_DIR", tmp_path)
    load_config.cache_clear()
    yield tmp_path, shipped
    load_config.cache_clear()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"action_protocol": "xml_blocks"}, "action_protocol 'xml_blocks' is not one of"),
        ({"tools": ["bash", "browser"]}, "tools ['browser'] are not among"),
        ({"tools": []}, "tools (none) are not among"),
        ({"tool_call_parser": "hermes9"}, "unknown tool-call parser 'hermes9'"),
        ({"reasoning_parser": "qwen9"}, "unknown reasoning parser 'qwen9'"),
        ({"history_reasoning": "sometimes"}, "history_reasoning 'sometimes' is not keep or drop"),
    ],
)
def test_a_config_with_an_unknown_protocol_tool_or_parser_is_refused(config_dir, change, message):
    folder, shipped = config_dir
    (folder / "bad.yaml").write_text(yaml.safe_dump({**shipped, **change}))
    with pytest.raises(UnknownConfig) as caught:
        load_config("bad")
    assert caught.value.reason == "UNKNOWN_AGENT_CONFIG"
    assert message in str(caught.value)
