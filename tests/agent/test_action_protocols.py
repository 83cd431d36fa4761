"""The action protocols behind one ActionProtocol (swerl.agent.actions.base): an episode picks
one from its agent config at its start, and each acts on one reply in a sandbox, appending the
reply and its observation to the conversation and the turn's step to the trajectory. The sandbox
is an in-memory one answering each command from a script; the episodes that run them on the real
stack are tests/agent/test_episodes_e2e.py and test_tool_episodes.py."""

from __future__ import annotations

import json

import pytest

from swerl.agent.actions.base import ActionTurn, SandboxBroken
from swerl.agent.actions.bash_block import BashBlockActions
from swerl.agent.actions.tool_turn import ToolCallActions
from swerl.agent.config import load_config
from swerl.agent.errors import EpisodeInfraError
from swerl.agent.loop.episode import Episode, EpisodeDeps
from swerl.agent.loop.sandbox import SANDBOX_NOT_RUNNING
from swerl.agent.policy.modes import PolicyTurn
from swerl.agent.spec import EpisodeSpec
from swerl.agent.v1 import agent_pb2 as pb
from swerl.exec.client import ExecResult
from swerl.exec.v1 import evaluate_pb2


def _spec(config: str = "") -> EpisodeSpec:
    return EpisodeSpec(
        episode_id="e1",
        instance=evaluate_pb2.SweInstance(
            instance_id="i1", problem_statement="fix it", image_name="img"
        ),
        config=load_config(config),
        api=pb.POLICY_API_SGLANG_GENERATE,
        endpoint="http://127.0.0.1:1",
        model="m",
        sampling_params={},
        request_timeout_s=10.0,
        max_turns=10,
        max_context_tokens=1000,
        max_new_tokens=100,
        wall_timeout_s=60.0,
        command_timeout_s=5.0,
        eval_timeout_s=60.0,
    )


def _exit(code: int, out: bytes = b"") -> ExecResult:
    return ExecResult(
        exit_code=code,
        stdout=out,
        stderr=b"",
        timed_out=False,
        output_truncated=False,
        bytes_dropped=0,
        duration_s=0.01,
        signaled=False,
    )


class _Sandbox:
    def __init__(self, answers: list[ExecResult | EpisodeInfraError]) -> None:
        self.answers = answers
        self.commands: list[str] = []

    async def run(self, command, *, timeout_s, env, cwd, stdin=None):
        self.commands.append(command)
        answer = self.answers.pop(0)
        if isinstance(answer, EpisodeInfraError):
            raise answer
        return answer


async def _cpu(fn):
    return fn()


def _answer(text: str) -> PolicyTurn:
    return PolicyTurn(text, "stop", 0, 0, False, 0.0)


def _turn(sandbox: _Sandbox, text: str, index: int = 0) -> ActionTurn:
    return ActionTurn(sandbox, index, _answer(text), 5, [], [])  # type: ignore[arg-type]


def _bash(command: str) -> str:
    return f"Running it.\n\n```bash\n{command}\n```"


def test_an_episode_acts_through_the_protocol_its_config_names() -> None:
    deps = EpisodeDeps(provider=None)  # type: ignore[arg-type]
    plain = Episode(_spec(), policy=None, deps=deps, emit=lambda _: None)  # type: ignore[arg-type]
    tools = Episode(_spec("tools"), policy=None, deps=deps, emit=lambda _: None)  # type: ignore[arg-type]
    assert isinstance(plain.actions, BashBlockActions)
    assert isinstance(tools.actions, ToolCallActions)


async def test_a_reply_without_one_bash_block_is_a_format_error_and_runs_nothing() -> None:
    sandbox = _Sandbox([])
    actions = BashBlockActions(_spec(), _cpu)
    turn = _turn(sandbox, "I will think about it.")
    acted = await actions.act(turn)
    assert acted.turn.format_error and acted.commands == 0 and acted.submission is None
    assert sandbox.commands == []
    assert [m["role"] for m in turn.messages] == ["assistant", "user"]
    assert acted.observed == turn.messages[-1]["content"]
    assert turn.steps == [
        {"turn": 0, "response": "I will think about it.", "format_error": True, "n_blocks": 0}
    ]
    assert actions.limit() is None and actions.metrics() == {}


async def test_a_bash_block_runs_once_and_its_output_is_the_observation() -> None:
    sandbox = _Sandbox([_exit(0, b"hello\n")])
    acted = await BashBlockActions(_spec(), _cpu).act(_turn(sandbox, _bash("echo hello")))
    assert sandbox.commands == ["echo hello"]
    assert acted.commands == 1 and acted.turn.action == "echo hello"
    assert acted.judged_action == "echo hello" and acted.judged_output == "hello\n"
    assert "hello" in acted.observed


async def test_a_sandbox_dead_after_the_policys_killing_command_is_broken_in_a_branch_too() -> None:
    lost = EpisodeInfraError(SANDBOX_NOT_RUNNING, "the sandbox could not be started again")
    sandbox = _Sandbox([_exit(137), lost, lost])
    trunk = BashBlockActions(_spec(), _cpu)
    await trunk.act(_turn(sandbox, _bash("kill -9 -1")))
    branch = trunk.branch()  # the fork copies what the last command did
    for actions in (trunk, branch):
        turn = _turn(sandbox, _bash("ls"), index=1)
        with pytest.raises(SandboxBroken):
            await actions.act(turn)
        assert turn.steps[-1]["sandbox_lost"] == "the sandbox could not be started again"


async def test_a_sandbox_dead_with_no_killing_command_is_the_infrastructures() -> None:
    lost = EpisodeInfraError(SANDBOX_NOT_RUNNING, "gone")
    with pytest.raises(EpisodeInfraError) as caught:
        await BashBlockActions(_spec(), _cpu).act(_turn(_Sandbox([lost]), _bash("ls")))
    assert not isinstance(caught.value, SandboxBroken)
    assert caught.value.reason == SANDBOX_NOT_RUNNING


async def test_tool_calls_run_in_order_and_count_per_tool() -> None:
    spec = _spec("tools")
    sandbox = _Sandbox([_exit(0, b"a\n"), _exit(0, b"b\n")])
    calls = "".join(
        "<tool_call>\n"
        + json.dumps({"name": "bash", "arguments": {"command": command}})
        + "\n</tool_call>\n"
        for command in ("echo a", "echo b")
    )
    episode = Episode(spec, policy=None, deps=EpisodeDeps(provider=None), emit=lambda _: None)  # type: ignore[arg-type]
    actions = episode.actions
    assert isinstance(actions, ToolCallActions)
    turn = _turn(sandbox, calls)
    acted = await actions.act(turn)
    assert sandbox.commands == ["echo a", "echo b"]
    assert acted.commands == 2 and acted.turn.action == "echo a\necho b"
    assert [m["role"] for m in turn.messages] == ["assistant", "tool", "tool"]
    assert acted.observed == turn.messages[1:]
    assert actions.metrics()["tool_calls_bash"] == 2.0
    # A branch counts on from the fork without touching the trunk's counts.
    branch = actions.branch()
    await branch.act(_turn(_Sandbox([_exit(0)]), calls.split("</tool_call>")[0] + "</tool_call>"))
    assert branch.metrics()["tool_calls_bash"] == 3.0
    assert actions.metrics()["tool_calls_bash"] == 2.0


async def test_replies_without_a_well_formed_call_reach_the_format_error_limit() -> None:
    spec = _spec("tools")
    limit = spec.config.max_format_errors
    assert limit > 0
    episode = Episode(spec, policy=None, deps=EpisodeDeps(provider=None), emit=lambda _: None)  # type: ignore[arg-type]
    actions = episode.actions
    for index in range(limit):
        assert actions.limit() is None
        acted = await actions.act(_turn(_Sandbox([]), "no call here", index=index))
        assert acted.turn.format_error and acted.commands == 0
    assert actions.limit() == (
        "LIMIT_FORMAT_ERRORS",
        f"{limit} replies in a row without a well-formed tool call",
    )
