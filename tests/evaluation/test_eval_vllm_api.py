"""`swerl eval --policy-api vllm`: the episodes' starts name VLLM_GENERATE, and branching (token
exact) is allowed on it as on sglang, refused on openai."""

from __future__ import annotations

import argparse

from swerl.agent.v1 import agent_pb2 as pb
from swerl.evaluation import cli
from swerl.evaluation.dataset import load_instances
from swerl.evaluation.runner import EvalConfig, episode_start
from swerl.tasks import default_tasks_dir


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["eval", "tasks", "-o", "out", *argv])


def test_policy_api_vllm_starts_vllm_generate_episodes() -> None:
    instance = load_instances(default_tasks_dir()).instances[0]
    config = EvalConfig(policy_endpoint="http://p:8000", policy_api="vllm", tokenizer_path="/t")
    start = episode_start(instance, config, "ep-v")
    assert start.policy.api == pb.POLICY_API_VLLM_GENERATE
    assert start.policy.tokenizer_path == "/t"
    assert _parse("--policy-api", "vllm").policy_api == "vllm"


def test_branching_needs_a_token_api() -> None:
    branching = ("--branch-at", "1", "--branches", "2", "--max-turns", "4")
    assert cli._branching_problem(_parse("--policy-api", "vllm", *branching)) is None
    assert cli._branching_problem(_parse("--policy-api", "openai", *branching)) == (
        "--branch-at/--branches need --policy-api sglang or vllm (token-exact forks)"
    )
