"""Each of the agent's defaults has one owner, and the parts that fall back to it take it from
there: a changed setting reaches every place that uses it, and the parts agree."""

from __future__ import annotations

import inspect

from swerl.agent import budget
from swerl.agent.config import load_config
from swerl.agent.gateway.parsing import (
    DEFAULT_REASONING_PARSER,
    DEFAULT_TOOL_CALL_PARSER,
    output_parser,
)
from swerl.agent.gateway.service import Gateway
from swerl.agent.gateway.session import SessionSpec
from swerl.agent.harnesses import DEFAULT_HARNESS, HARNESSES, harness_named
from swerl.agent.judging.steps import PRM_STEP_TIMEOUT_S, PrmSpec
from swerl.agent.loop.sandbox import PoolSandboxProvider
from swerl.agent.settings import POLICY_REQUEST_TIMEOUT_S, AgentSettings
from swerl.agent.spec import is_harnessed


def _default(function: object, name: str) -> object:
    return inspect.signature(function).parameters[name].default  # type: ignore[arg-type]


def test_the_lease_wait_is_the_agents_setting_wherever_it_is_counted():
    fields = AgentSettings.model_fields
    assert fields["lease_wait_s"].default == budget.DEFAULT_LEASE_WAIT_S == 600.0
    assert _default(PoolSandboxProvider.__init__, "lease_wait_s") == budget.DEFAULT_LEASE_WAIT_S
    assert _default(budget.client_deadline, "lease_wait_s") == budget.DEFAULT_LEASE_WAIT_S


def _gateway(**options: object) -> Gateway:
    return Gateway(http_session=None, codecs=None, executor=None, **options)  # type: ignore[arg-type]


def test_a_gateway_session_naming_no_timeout_gets_the_agents_policy_request_timeout():
    assert AgentSettings.model_fields["policy_request_timeout_s"].default == (
        POLICY_REQUEST_TIMEOUT_S
    )
    spec = SessionSpec(endpoint="http://127.0.0.1:1", tokenizer_path="")
    plain = _gateway()._policy(spec, "s-1")
    assert plain._timeout.total == POLICY_REQUEST_TIMEOUT_S  # type: ignore[attr-defined]
    # The agent passes its setting: a changed setting reaches the sessions.
    configured = _gateway(request_timeout_s=42.0)._policy(spec, "s-2")
    assert configured._timeout.total == 42.0  # type: ignore[attr-defined]
    # A session that names its own keeps it.
    own = SessionSpec(endpoint="http://127.0.0.1:1", tokenizer_path="", request_timeout_s=7.0)
    assert _gateway(request_timeout_s=42.0)._policy(own, "s-3")._timeout.total == 7.0  # type: ignore[attr-defined]


def test_a_session_naming_no_parsers_gets_the_gateways_defaults():
    parser = output_parser("", "")
    assert (parser.tool_call_parser, parser.reasoning_parser) == (
        DEFAULT_TOOL_CALL_PARSER,
        DEFAULT_REASONING_PARSER,
    )
    # The shipped tools config names the same family, as its own choice.
    tools = load_config("tools")
    assert (tools.tool_call_parser, tools.reasoning_parser) == ("qwen25", "qwen3")
    assert output_parser(tools.tool_call_parser, "none").reasoning_parser is None


def test_the_prm_step_timeout_has_one_default():
    assert PrmSpec().timeout_s == PRM_STEP_TIMEOUT_S == 120.0


def test_the_default_harness_is_the_builtin_loop_by_one_name():
    assert harness_named("").name == DEFAULT_HARNESS == "builtin"
    assert HARNESSES[DEFAULT_HARNESS] is type(harness_named(""))
    assert not is_harnessed("") and not is_harnessed(DEFAULT_HARNESS)
    assert is_harnessed("mini-swe-agent")
